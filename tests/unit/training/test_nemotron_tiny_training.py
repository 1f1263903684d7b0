"""The tiny Nemotron-VL model learns an image-dependent answer (loss falls) with auxiliary-free MoE
balancing on, and the balancer reports the moe/* metrics and the expert-load table."""
import torch

from megatron_vlm.models import build_model
from megatron_vlm.testing.tiny_nemotron_vl import build_tiny_nemotron_vl_tokenizer, tiny_nemotron_vl_hf_config
from megatron_vlm.training.moe_balancing import MoEConfig, MoELoadBalancer


def test_tiny_model_learns_and_reports_moe_metrics():
    cfg = tiny_nemotron_vl_hf_config(build_tiny_nemotron_vl_tokenizer())
    torch.manual_seed(0)
    model = build_model(cfg).train()
    balancer = MoELoadBalancer(model, MoEConfig(bias_update_rate=1e-3, n_step_per_workload_report=4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    img, g = cfg["image_token_id"], torch.Generator().manual_seed(0)
    losses, reports = [], []
    for step in range(1, 17):
        ids, pixels = [], []
        for _ in range(2):  # two packed samples; the answer token is the image's brightness class
            c = int(torch.randint(0, 3, (1,), generator=g))
            pixels.append(float(c) + 0.1 * torch.randn(16, 3 * 16 * 16, generator=g))
            ids.append(torch.tensor([5, 6] + [img] * 4 + [7, 20 + c, 2]))
        cu = torch.tensor([0, 9, 18], dtype=torch.int32)
        logits = model(torch.cat(ids)[None], pixel_values=torch.cat(pixels), image_grid_hw=torch.tensor([[4, 4]] * 2),
                       cu_seqlens=cu)
        labels = torch.cat(ids)[1:]
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        report = balancer.after_step(step)
        if report is not None:
            reports.append(report)
    assert sum(losses[-3:]) / 3 < 0.5 * sum(losses[:3]) / 3, losses
    assert len(reports) == 4
    metrics, table = reports[-1]
    assert metrics["moe/tokens_per_layer_mean"] == 4 * 18  # 4 steps x 18 tokens, one MoE layer
    assert 0 < metrics["moe/max_fraction_max"] <= 1 and 0 < metrics["moe/entropy_mean"] <= torch.log(torch.tensor(8.0))
    assert len(table) == 1 and sum(table[0]) == 4 * 18 * 2  # top-2 assignments
    assert float(model.language_model.layers[1].mixer.gate.e_score_correction_bias.abs().sum()) > 0
