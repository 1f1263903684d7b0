"""The precomputed reference: one pass sums every response's log-probs into a [pairs, 2] table per split,
written to the run folder; a restart reads the file instead of scoring again, and a file of other sizes
is scored again. `pair_sums` on a pack with an empty pair list gives empty tensors."""
from __future__ import annotations

import torch

from megatron_vlm.data.batch import IGNORE_INDEX
from megatron_vlm.training.dpo.reference import REFERENCE_FILE, PrecomputedReference
from megatron_vlm.training.dpo.sequence import pair_sums


def _pack(pair_ids, lengths):
    """A pack of pairs whose sequences have `lengths` tokens, the last two of each labelled."""
    labels, cu = [], [0]
    for n in lengths:
        lab = torch.full((n,), IGNORE_INDEX)
        lab[n - 3:n - 1] = torch.arange(2) + 5
        labels.append(lab)
        cu.append(cu[-1] + n)
    lab = torch.cat(labels)[None]
    return {"input_ids": torch.zeros_like(lab), "labels": lab, "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
            "pair_index": torch.tensor(pair_ids), "num_pairs": torch.tensor(len(pair_ids))}


class _Scorer(torch.nn.Module):
    """log-prob of a labelled token = -(its position in the pack + 1) / 10; counts its calls."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, batch):
        self.calls += 1
        pos = torch.nonzero(batch["labels"].reshape(-1) != IGNORE_INDEX).flatten()
        return -(pos.double() + 1) / 10


class _Loader(list):
    num_pairs = 3


def test_precompute_then_read_back(tmp_path):
    loader = _Loader([_pack([2, 0], [5, 6, 4, 7]), _pack([1], [6, 5])])
    scorer = _Scorer()
    ref = PrecomputedReference.load_or_compute(tmp_path, scorer, {"train": loader}, device=torch.device("cpu"), copies=1,
                                               is_main=True, model_path="m")
    assert scorer.calls == 2 and (tmp_path / REFERENCE_FILE).is_file()
    # pair 2: positions 2, 3 (chosen) and 8, 9 (rejected) of the first pack; pair 0: 12, 13 and 19, 20
    want = {2: (-(3 + 4) / 10, -(9 + 10) / 10), 0: (-(13 + 14) / 10, -(20 + 21) / 10), 1: (-(4 + 5) / 10, -(9 + 10) / 10)}
    for i, (c, r) in want.items():
        assert torch.allclose(ref.tables["train"][i], torch.tensor([c, r], dtype=torch.float64))
    chosen, rejected = ref.pair_logps(loader[0], "train")
    assert torch.allclose(chosen, torch.tensor([want[2][0], want[0][0]], dtype=torch.float32))
    assert torch.allclose(rejected, torch.tensor([want[2][1], want[0][1]], dtype=torch.float32))
    # pair_sums of the same pack: the same sums, and the response token counts
    c, r, nc, nr = pair_sums(scorer(loader[0]), loader[0])
    assert torch.allclose(c, chosen.double()) and nc.tolist() == [2, 2] and nr.tolist() == [2, 2]
    again = PrecomputedReference.load_or_compute(tmp_path, scorer, {"train": loader}, device=torch.device("cpu"),
                                                 copies=1, is_main=True, model_path="m")
    assert scorer.calls == 3 and torch.equal(again.tables["train"], ref.tables["train"])  # read, not scored (+1 above)
    other = _Loader(loader)
    other.num_pairs = 4
    PrecomputedReference.load_or_compute(tmp_path, scorer, {"train": other}, device=torch.device("cpu"), copies=1,
                                         is_main=True, model_path="m")
    assert scorer.calls == 5  # other sizes: scored again


def test_pair_sums_of_an_empty_pack():
    pack = {"labels": torch.full((1, 1), IGNORE_INDEX), "cu_seqlens": torch.tensor([0, 1], dtype=torch.int32),
            "num_pairs": torch.tensor(0)}
    out = pair_sums(torch.zeros(0), pack)
    assert all(t.numel() == 0 for t in out)


class _PlannedLoader(list):
    """A pass loader whose split has 3 rows, with the pair lengths the run would plan (-1: skipped)."""
    num_pairs = 3

    def __init__(self, packs, planned):
        super().__init__(packs)
        self.planned_lengths = planned


def test_a_file_scored_without_some_pairs_is_scored_again(tmp_path):
    """A restart with a larger data.max_tokens_per_pack plans pairs the file never scored (their rows are 0):
    the same split sizes must not make it read the stale table (reference log p = 0 for those pairs)."""
    scorer = _Scorer()
    small = _PlannedLoader([_pack([2, 0], [5, 6, 4, 7])], [9, -1, 9])  # pair 1 was too long: not scored
    first = PrecomputedReference.load_or_compute(tmp_path, scorer, {"train": small}, device=torch.device("cpu"),
                                                 copies=1, is_main=True, model_path="m")
    assert scorer.calls == 1 and first.tables["train"][1].abs().sum() == 0
    bigger = _PlannedLoader([_pack([2, 0], [5, 6, 4, 7]), _pack([1], [6, 5])], [9, 11, 9])
    again = PrecomputedReference.load_or_compute(tmp_path, scorer, {"train": bigger}, device=torch.device("cpu"),
                                                 copies=1, is_main=True, model_path="m")
    assert scorer.calls == 3  # scored again: pair 1 is in the plan now
    assert torch.allclose(again.tables["train"][1], torch.tensor([-(4 + 5) / 10, -(9 + 10) / 10], dtype=torch.float64))
    PrecomputedReference.load_or_compute(tmp_path, scorer, {"train": bigger}, device=torch.device("cpu"), copies=1,
                                         is_main=True, model_path="m")
    assert scorer.calls == 3  # the same plan: read back


def test_a_file_scored_on_other_pairs_of_the_same_plan_is_scored_again(tmp_path):
    """An edited data file (or another synthetic seed) with the same row count and lengths: the rows are other
    pairs under the same indices, so the table is scored again."""
    scorer = _Scorer()
    packs = [_pack([2, 0], [5, 6, 4, 7]), _pack([1], [6, 5])]
    before = _PlannedLoader(packs, [9, 11, 9])
    before.data_identity = {"pairs": {"files": [{"file": "/d/train.jsonl", "size": 100, "mtime_ns": 1}]}}
    PrecomputedReference.load_or_compute(tmp_path, scorer, {"train": before}, device=torch.device("cpu"), copies=1,
                                         is_main=True, model_path="m")
    assert scorer.calls == 2
    edited = _PlannedLoader(packs, [9, 11, 9])
    edited.data_identity = {"pairs": {"files": [{"file": "/d/train.jsonl", "size": 100, "mtime_ns": 2}]}}
    PrecomputedReference.load_or_compute(tmp_path, scorer, {"train": edited}, device=torch.device("cpu"), copies=1,
                                         is_main=True, model_path="m")
    assert scorer.calls == 4


def test_initial_model_identity_changes_with_the_starting_adapter(tmp_path):
    """The precomputed reference is scored from base + lora.init_from: another adapter (or the same folder with new
    weights) must not reuse a table scored from the old one; without an adapter the identity is the model path."""
    from types import SimpleNamespace

    from megatron_vlm.training.dpo.build import initial_model_identity

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"1234")
    cfg = SimpleNamespace(model=SimpleNamespace(path="/m"), lora=SimpleNamespace(init_from=str(adapter), init_from_mode="continue"))
    first = initial_model_identity(cfg)
    assert first != "/m" and initial_model_identity(cfg) == first
    (adapter / "adapter_model.safetensors").write_bytes(b"123456")  # new weights in the same folder
    assert initial_model_identity(cfg) != first
    cfg.lora.init_from_mode = "merge"
    assert initial_model_identity(cfg) != first


def test_initial_model_identity_changes_with_the_model_folders_weights(tmp_path):
    """The table is scored from `model.path`'s weights: a folder written again in place (a longer SFT run exported
    to the same path, after a DPO start that scored the reference and stopped) must be scored again, not read
    back as the reference of a model that is no longer there. Found by reading: the identity was the path alone."""
    from types import SimpleNamespace

    from megatron_vlm.training.dpo.build import initial_model_identity

    model = tmp_path / "sft" / "hf"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"1234")
    cfg = SimpleNamespace(model=SimpleNamespace(path=str(model)), lora=None)
    first = initial_model_identity(cfg)
    assert initial_model_identity(cfg) == first
    (model / "model.safetensors").write_bytes(b"123456")  # exported again at the same path
    assert initial_model_identity(cfg) != first


class _TokenScorer(torch.nn.Module):
    """log-prob of a labelled token = a function of the token alone, -(id % 7 + 1) / 10: the same in any pack."""

    def forward(self, batch):
        labels = batch["labels"].reshape(-1)
        return -((labels[labels != IGNORE_INDEX] % 7).double() + 1) / 10


def test_a_pair_the_reference_pass_could_not_score_is_skipped_and_counted_not_trained_against_zero(tmp_path):
    """A pair that fails in the one reference pass (a transient read error, a pack it could not join) and then
    processes in a training pack has no reference row: it is skipped there and counted, never trained against a
    reference log-prob of 0."""
    from types import SimpleNamespace

    from megatron_vlm.data.bad_records import BadRecordLog
    from megatron_vlm.data.config import DataConfig
    from megatron_vlm.data.preference_loader import build_preference_dataloader
    from megatron_vlm.data.processor import load_processor
    from megatron_vlm.testing.synthesize import synthesize_model_folder
    from megatron_vlm.training.dpo.build import build_reference
    from megatron_vlm.training.dpo.config import DPOConfig
    from megatron_vlm.training.signals import StopFlag

    folder = synthesize_model_folder("tiny_qwen2_5_vl", tmp_path / "model", seed=0)
    data = DataConfig(type="synthetic_vqa", synthetic_dir=str(tmp_path / "data"), synthetic_train_size=10,
                      synthetic_eval_size=0, max_tokens_per_pack=256, num_workers=0, shuffle=False)
    processor, bad = load_processor(folder), BadRecordLog()
    loader = build_preference_dataloader(data, processor, seed=0, dp_rank=0, dp_size=1, bad_records=bad)
    ctx = SimpleNamespace(cfg=SimpleNamespace(data=data, lora=None, model=SimpleNamespace(path=str(folder))),
                          env=SimpleNamespace(device=torch.device("cpu"), is_main=True, rank=0), run_dir=tmp_path,
                          stop=StopFlag())
    bundle = SimpleNamespace(dims=SimpleNamespace(dp_rank=0, dp_size=1, data_copies=1), processor=processor,
                             wrapper=_TokenScorer())
    processor_of = loader.dataset.processor
    failing = 3

    def flaky(i, bad_list):  # pair 3 fails while the reference pass reads it, and only then
        if i == failing:
            bad_list.append((*processor_of.halves.locate(2 * i), "missing_image", "read error (transient)"))
            return None
        return processor_of(i, bad_list)

    loader.dataset.processor = flaky
    reference = build_reference(ctx, bundle, DPOConfig(reference="precomputed"), loader, None)
    loader.dataset.processor = processor_of
    seen = set()
    it = iter(loader)
    for _ in range(loader.packs_per_epoch):
        pack = next(it)
        seen.update(pack["pair_index"].tolist())
        chosen, rejected = reference.pair_logps(pack, "train")
        want = pair_sums(_TokenScorer()(pack), pack)
        torch.testing.assert_close(chosen, want[0].float())
        torch.testing.assert_close(rejected, want[1].float())
    assert seen == set(range(10)) - {failing}
    assert any(r.index == processor_of.halves.locate(2 * failing)[1] and r.category == "reference_unscored"
               for r in bad.entries)


class _KeyedLoader:
    """A pass loader as `build_preference_pass_loader` gives it: `keys` (one per pack) read on iteration; counts reads."""
    num_pairs = 3

    def __init__(self, packs):
        self.packs, self.keys, self.reads = packs, list(range(len(packs))), []

    def __len__(self):
        return len(self.keys)

    def __iter__(self):
        for k in self.keys:
            self.reads.append(k)
            yield self.packs[k]


def test_a_stop_request_during_the_pass_saves_it_and_the_restart_continues(tmp_path):
    """SIGTERM during the precomputed pass (a long one: every pair of the split before step 1) was acted on only at
    the first step, so a job killed after its grace period lost the whole pass. Now the pass asks the stop flag after
    each pack: it saves the sums so far and raises `ReferencePassStopped` (the job exits 143); the next start scores
    only the packs left, and the table equals an uninterrupted pass's."""
    import os
    import signal

    import pytest

    from megatron_vlm.training.dpo.reference import REFERENCE_PARTIAL_FILE, ReferencePassStopped
    from megatron_vlm.training.signals import StopFlag

    packs = [_pack([2, 0], [5, 6, 4, 7]), _pack([1], [6, 5])]
    (tmp_path / "straight").mkdir()
    straight = PrecomputedReference.load_or_compute(tmp_path / "straight", _Scorer(), {"train": _Loader(packs)},
                                                    device=torch.device("cpu"), copies=1, is_main=True, model_path="m")
    run = tmp_path / "run"
    run.mkdir()
    flag = StopFlag().install()
    try:
        class _Signalling(_Scorer):
            def forward(self, batch):
                if self.calls == 0:
                    os.kill(os.getpid(), signal.SIGTERM)  # arrives while the first pack is scored
                return super().forward(batch)

        first = _KeyedLoader(packs)
        with pytest.raises(ReferencePassStopped):
            PrecomputedReference.load_or_compute(run, _Signalling(), {"train": first}, device=torch.device("cpu"),
                                                 copies=1, is_main=True, model_path="m",
                                                 stop=lambda: flag.should_stop(torch.device("cpu")))
    finally:
        flag.restore()
    assert first.reads == [0] and (run / REFERENCE_PARTIAL_FILE).is_file() and not (run / REFERENCE_FILE).is_file()
    scorer, again = _Scorer(), _KeyedLoader(packs)
    ref = PrecomputedReference.load_or_compute(run, scorer, {"train": again}, device=torch.device("cpu"), copies=1,
                                               is_main=True, model_path="m", stop=lambda: False)
    assert scorer.calls == 1 and again.reads == [1]  # the first pack is neither read nor scored again
    assert torch.equal(ref.tables["train"], straight.tables["train"])
    assert torch.equal(ref.scored["train"], straight.scored["train"])
    assert (run / REFERENCE_FILE).is_file() and not (run / REFERENCE_PARTIAL_FILE).is_file()


def test_a_partial_pass_of_another_model_is_not_continued(tmp_path):
    import pytest

    from megatron_vlm.training.dpo.reference import ReferencePassStopped

    packs = [_pack([2, 0], [5, 6, 4, 7]), _pack([1], [6, 5])]
    with pytest.raises(ReferencePassStopped):
        PrecomputedReference.load_or_compute(tmp_path, _Scorer(), {"train": _Loader(packs)}, device=torch.device("cpu"),
                                             copies=1, is_main=True, model_path="m", stop=lambda: True)
    scorer = _Scorer()
    PrecomputedReference.load_or_compute(tmp_path, scorer, {"train": _Loader(packs)}, device=torch.device("cpu"),
                                         copies=1, is_main=True, model_path="other")
    assert scorer.calls == 2  # another model: scored from the start


def test_run_dpo_exits_143_when_the_reference_pass_is_stopped(monkeypatch):
    """The job wiring: a stopped pass ends `run_dpo` at once with the stop exit code (no step, no checkpoint)."""
    from types import SimpleNamespace

    import megatron_vlm.jobs as jobs
    from megatron_vlm.training.dpo.reference import ReferencePassStopped
    from megatron_vlm.training.loop import EXIT_STOPPED

    def stopped(*a, **k):
        raise ReferencePassStopped("dpo: stop requested during the reference pass")

    monkeypatch.setattr(jobs, "dpo_section", lambda cfg: SimpleNamespace())
    monkeypatch.setattr(jobs, "prepare_sft_data", lambda ctx: None)
    monkeypatch.setattr(jobs, "build_model_bundle", lambda ctx: SimpleNamespace(model=None, layer_kinds=()))
    monkeypatch.setattr(jobs, "check_moe_section", lambda *a: None)
    monkeypatch.setattr(jobs, "build_pair_loaders", lambda *a: (None, None))
    monkeypatch.setattr(jobs, "build_reference", stopped)
    monkeypatch.setattr(jobs, "total_steps", lambda *a: (_ for _ in ()).throw(AssertionError("no step after a stop")))
    assert jobs.run_dpo(SimpleNamespace(cfg=SimpleNamespace())) == EXIT_STOPPED == 143


def test_an_unreadable_reference_file_is_scored_again_not_a_crash_at_every_start(tmp_path):
    """The complete reference file truncated or emptied (a crash of the host after its rename: it is not fsynced, a
    full disk, a copy cut short) made every start of the run end in torch.load's traceback before step 1, until the
    file was found and deleted by hand; the partial file of a stopped pass was already read leniently. Scored again,
    as the same pass into an empty folder scores it (reference: the tables of a fresh pass)."""
    loader = _Loader([_pack([2, 0], [5, 6, 4, 7]), _pack([1], [6, 5])])
    (tmp_path / "fresh").mkdir()
    fresh = PrecomputedReference.load_or_compute(tmp_path / "fresh", _Scorer(), {"train": loader},
                                                 device=torch.device("cpu"), copies=1, is_main=True, model_path="m")
    for damaged in (b"", (tmp_path / "fresh" / REFERENCE_FILE).read_bytes()[:100]):
        run = tmp_path / f"run{len(damaged)}"
        run.mkdir()
        (run / REFERENCE_FILE).write_bytes(damaged)
        scorer = _Scorer()
        ref = PrecomputedReference.load_or_compute(run, scorer, {"train": loader}, device=torch.device("cpu"), copies=1,
                                                   is_main=True, model_path="m")
        assert scorer.calls == 2 and torch.equal(ref.tables["train"], fresh.tables["train"])
        assert torch.equal(torch.load(run / REFERENCE_FILE, weights_only=True)["tables"]["train"], fresh.tables["train"])
