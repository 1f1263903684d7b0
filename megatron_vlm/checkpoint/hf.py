"""Hugging Face model folders: load into our modules, save back in the layout transformers loads.

Loading (`load_hf_model`): config.json -> family (by `model_type`) -> module built on the meta
device -> materialised empty on the target device in the target dtype -> safetensors read one
tensor at a time (single `model.safetensors` or shards listed in `model.safetensors.index.json`),
converted by the family's state-dict adapter and copied into place. Peak host memory is about one
copy of the weights plus one tensor. Every parameter must be filled exactly once: missing,
unexpected or mis-shaped tensors are errors naming the keys. Only safetensors are read (no pickle).

Saving (`save_hf_model`): the adapter maps our state dict to HF keys; tensors are written as
safetensors (sharded with an index past `max_shard_size`), with the model's original config.json
dict (`model.hf_config`, dtype fields updated to what is written) and its generation config; with
`copy_from`, the tokenizer / processor / chat-template files of a source folder are copied too (and its Python
files when a config names remote code: an `auto_map` kept in the export needs them).
The folder is never written in place (a symlink: the folder it names, `export_folder`): everything
goes to a temporary sibling (`.<name>.tmp`), the files of an existing folder that this export does
not rewrite (e.g. a processor written there first) are carried over — files of the previous export
(weights, adapter, generation config; with `copy_from`, tokenizer / processor files) are not — the
whole is fsynced, the old folder is moved
to `.<name>.old`, the new one renamed into place, a `.export_complete` marker written and the old
folder deleted (`replace_dir`). A crash or a full disk therefore never destroys
the previous export: at worst it is found under `.<name>.old`, and the next export tidies up.
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Optional, Union

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from megatron_vlm.durable import fsync_dir, fsync_tree, write_text_durably
from megatron_vlm.finite import check_finite
from megatron_vlm.models.common.lora import lora_modules, merged_state_dict
from megatron_vlm.models.registry import family_for_args, get_family

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
EXPORT_MARKER = ".export_complete"
"""Written last into a Hugging Face folder by `save_hf_model` (after every file is on disk)."""
# files of a model folder that describe tokenisation / preprocessing / generation, copied on export
_TOKENIZER_FILE_PATTERNS = [
    r"tokenizer.*", r"vocab\..*", r"merges\.txt", r"special_tokens_map\.json", r"added_tokens\.json",
    r"chat_template\..*", r"preprocessor_config\.json", r"video_preprocessor_config\.json",
    r"processor_config\.json", r"generation_config\.json", r".*\.tiktoken",
]
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def read_hf_config(path: Union[str, Path]) -> dict:
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{path}: no config.json (is this a Hugging Face model folder?)")
    return json.loads(cfg_path.read_text())


def safetensors_files(path: Union[str, Path]) -> list[Path]:
    """The weight files of a folder: the shards named by the index, or the single model.safetensors."""
    path = Path(path)
    if (path / _INDEX).is_file():
        index = json.loads((path / _INDEX).read_text())
        names = sorted(set(index.get("weight_map", {}).values()))
        if not names:
            raise ValueError(f"{path / _INDEX}: empty weight_map")
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise FileNotFoundError(f"{path}: shards listed in {_INDEX} are missing: {missing}")
        return [path / n for n in names]
    if (path / _SINGLE).is_file():
        return [path / _SINGLE]
    others = sorted(p.name for p in path.glob("*.safetensors"))
    if others:
        return [path / n for n in others]
    raise FileNotFoundError(f"{path}: no {_SINGLE} or {_INDEX} (only safetensors checkpoints are read)")


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, tensor) over all files, one tensor in memory at a time."""
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as reader:
            for key in reader.keys():  # noqa: SIM118 -- safe_open handles are not iterable
                yield key, reader.get_tensor(key)


@torch.no_grad()
def load_hf_weights(model: nn.Module, path: Union[str, Path], adapter) -> None:
    """Fill every parameter of `model` (already materialised) from the folder's safetensors via `adapter`."""
    params = dict(model.named_parameters())  # tied parameters appear once, under their first name
    buffers = {k: b for k, b in model.named_buffers()}
    targets = {**params, **buffers}
    loaded: set[str] = set()
    pending: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for hf_key, tensor in iter_safetensors(safetensors_files(path)):
        converted, pending = adapter.from_hf({**pending, hf_key: tensor})
        for key, value in converted.items():
            target = targets.get(key)
            if target is None:
                unexpected.append(f"{key} (from {hf_key})")
                continue
            if tuple(value.shape) != tuple(target.shape):
                raise ValueError(
                    f"{path}: {hf_key} -> {key} has shape {tuple(value.shape)}, the model expects {tuple(target.shape)}"
                )
            if key in loaded:
                raise ValueError(f"{path}: {key} is given twice (last from {hf_key})")
            target.copy_(value.to(dtype=target.dtype))
            loaded.add(key)
    if pending:
        raise ValueError(f"{path}: tensors that could not be converted (incomplete groups): {sorted(pending)[:10]}")
    if unexpected:
        raise ValueError(f"{path}: checkpoint tensors with no place in the model: {unexpected[:10]}"
                         + (f" (+{len(unexpected) - 10} more)" if len(unexpected) > 10 else ""))
    missing = sorted(set(params) - loaded)
    default_for = getattr(adapter, "default_for", None)
    if missing and default_for is not None:
        # tensors a family's published checkpoints may omit (e.g. C-RADIO layer scales = identity)
        still = []
        for key in missing:
            value = default_for(key, tuple(params[key].shape))
            if value is None:
                still.append(key)
            else:
                params[key].copy_(value.to(dtype=params[key].dtype))
        missing = still
    if missing:
        raise ValueError(f"{path}: model parameters missing from the checkpoint: {missing[:10]}"
                         + (f" (+{len(missing) - 10} more)" if len(missing) > 10 else ""))


def load_hf_model(
    path: Union[str, Path], dtype: torch.dtype = torch.float32, device: Union[torch.device, str] = "cpu"
) -> nn.Module:
    """Build the family named by config.json's model_type and load its weights (see module docstring)."""
    path = Path(path)
    hf_config = read_hf_config(path)
    family = get_family(hf_config.get("model_type"))
    args = family.args_cls.from_hf_config(hf_config)
    with torch.device("meta"):
        model = family.model_cls(args, hf_config=hf_config)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.tie_weights()
    load_hf_weights(model, path, family.state_dict_adapter(args))
    gen = path / "generation_config.json"
    if gen.is_file():
        model.hf_generation_config = json.loads(gen.read_text())
    return model


def _parse_size(size: Union[int, str]) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", size, flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"max_shard_size: cannot parse {size!r} (examples: 5GB, 500MB, 1000000)")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}[unit]
    return int(float(m.group(1)) * scale)


def _full_tensor(t: torch.Tensor) -> torch.Tensor:
    if hasattr(t, "full_tensor"):  # DTensor (FSDP2 / TP shard): gather; collective on all ranks
        t = t.full_tensor()
    return t.detach().to("cpu").contiguous()


def _fp32_by_design(model: nn.Module) -> set[str]:
    """State-dict keys the model keeps fp32 whatever its dtype: `fp32_weight` router weights (Nemotron-H) and
    score-correction biases (transformers keeps both in fp32; an export in bf16 would round them)."""
    kept = {f"{name}.weight" if name else "weight" for name, m in model.named_modules() if getattr(m, "fp32_weight", False)}
    kept |= {name for name, _ in model.named_buffers() if name.rsplit(".", 1)[-1] == "e_score_correction_bias"}
    return kept


def cast_for_export(state: dict[str, torch.Tensor], model: Optional[nn.Module], dtype: Optional[torch.dtype]) -> dict:
    """`state` (our names, `model`'s) with its floating tensors in `dtype` (None: as they are), but for those `model`
    keeps fp32 on purpose (`_fp32_by_design`), which stay fp32 as transformers keeps them."""
    if dtype is None:
        return state
    kept = _fp32_by_design(model) if model is not None else set()
    return {k: (v.to(dtype) if v.is_floating_point() and k not in kept else v) for k, v in state.items()}


def save_hf_model(
    model: nn.Module,
    path: Union[str, Path],
    *,
    max_shard_size: Union[int, str] = "5GB",
    copy_from: Optional[Union[str, Path]] = None,
    dtype: Optional[torch.dtype] = None,
    pixel_limits: Optional[dict[str, Optional[int]]] = None,
) -> Path:
    """Write `model` as a Hugging Face folder that `AutoModelForImageTextToText.from_pretrained` loads.

    `pixel_limits` (the run's `data.min_pixels` / `max_pixels` / `video_min_pixels` / `video_max_pixels`; None
    keeps the folder's) go into the copied processor configs: see `write_pixel_limits`.

    `dtype` converts floating tensors on the way out (default: as held), but for those the model keeps fp32 on
    purpose (`_fp32_by_design`). A model with LoRA adapters is
    written merged (`models.common.lora.merged_state_dict`). Returns the folder.
    The folder is replaced as a whole once complete (see the module docstring): a crash or a full
    disk leaves the previous folder intact.
    """
    path = export_folder(path)
    args = model.args
    family = family_for_args(args)
    adapter = family.state_dict_adapter(args)
    ours = {k: _full_tensor(v) for k, v in model.state_dict().items()}
    adapted = lora_modules(model)
    if adapted:  # LoRA: the export is the merged model (W + scaling B A), which transformers loads as is
        ours = merged_state_dict(ours, next(iter(adapted.values())).scaling)
    ours = cast_for_export(ours, model, dtype)
    hf = adapter.to_hf(ours)
    check_finite(hf, f"refusing to export {path}")  # a non-finite export is never written (nor replaces a good one)

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp"
    old = path.parent / f".{path.name}.old"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        _write_hf_files(model, args, hf, tmp, max_shard_size, copy_from)
        if pixel_limits:
            write_pixel_limits(tmp, **pixel_limits)
        share_like_umask(tmp)
        previous = path if path.is_dir() else old if old.is_dir() else None  # old: a crash between two renames
        if previous is not None:  # with copy_from, the tokenizer / processor files are the source's alone
            owned = _EXPORT_OWNED + (_TOKENIZER_FILE_PATTERNS + [r".*\.py"] if copy_from is not None else [])
            _carry_over(previous, tmp, owned=owned)
        replace_dir(tmp, path, old, marker=EXPORT_MARKER, marker_text="hugging face export complete\n",
                    is_complete=Path.is_dir)  # any existing folder is kept until the new one is in place
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _write_hf_files(model: nn.Module, args, hf: dict[str, torch.Tensor], path: Path, max_shard_size, copy_from) -> None:
    """Weights (sharded past `max_shard_size`), config.json, generation config, tokenizer files into `path`."""
    # shards: greedy in key order; a tensor larger than the limit gets a shard of its own
    limit = _parse_size(max_shard_size)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(hf):
        nbytes = hf[key].numel() * hf[key].element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][key] = hf[key]
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(_unshare(shards[0]), str(path / _SINGLE), metadata=meta)
    else:
        weight_map = {}
        n = len(shards)
        for i, shard in enumerate(shards, start=1):
            name = f"model-{i:05d}-of-{n:05d}.safetensors"
            save_file(_unshare(shard), str(path / name), metadata=meta)
            weight_map.update({k: name for k in shard})
        total = sum(t.numel() * t.element_size() for t in hf.values())
        (path / _INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))

    config = dict(getattr(model, "hf_config", None) or args.to_hf_config())
    name = _DTYPE_NAMES.get(_main_dtype(hf))
    if name:
        config = {**_with_dtype(config, name), "dtype": name}
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    gen = getattr(model, "hf_generation_config", None)
    if gen:
        (path / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if copy_from is not None:
        copy_tokenizer_files(copy_from, path, overwrite_generation_config=not gen)


def _main_dtype(hf: dict[str, torch.Tensor]) -> Optional[torch.dtype]:
    """The floating dtype holding most of the weights (None: no floating tensor). A bf16 export keeps a few tensors
    fp32 on purpose (`_fp32_by_design`); config.json must still name bf16, the dtype transformers' `dtype="auto"`
    and vLLM load the model in (fp32 would double its memory)."""
    numel: dict[torch.dtype, int] = {}
    for v in hf.values():
        if v.is_floating_point():
            numel[v.dtype] = numel.get(v.dtype, 0) + v.numel()
    return max(numel, key=lambda d: numel[d]) if numel else None


def _with_dtype(config: dict, name: str) -> dict:
    """`config` with its `dtype` set to `name`, and every `dtype` / `torch_dtype` field already there (also in
    nested sub-configs such as text_config) too, so none names a dtype the weights are not in."""
    out = {k: (_with_dtype(v, name) if isinstance(v, dict) else v) for k, v in config.items()}
    for key in ("dtype", "torch_dtype"):
        if key in out:
            out[key] = name
    return out


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


_EXPORT_OWNED = [
    r".*\.safetensors", r".*\.safetensors\.index\.json", r"pytorch_model.*\.bin(\.index\.json)?", r"config\.json",
    r"generation_config\.json", r"adapter_config\.json", r"adapter_model\..*", r"\.(export|adapter)_complete",
]
"""Files that belong to one export (weights of any kind, a PEFT adapter, the model and generation configs,
markers): never carried over from the folder an export replaces, so an export never mixes files of two
exports (a stale adapter_config.json beside merged weights makes transformers + peft apply the LoRA twice)."""


def _carry_over(old: Path, new: Path, owned: list[str]) -> None:
    """Hard-link (or copy) into `new` what `old` holds that `new` lacks, except the files of an export (`owned`:
    `_EXPORT_OWNED`, and the tokenizer / processor files when the export copies them from a source folder, so none
    of another model's is left beside them): writing an export into a folder keeps its other files (a processor
    written there first, for an export without a source folder), as writing in place did."""
    for entry in old.iterdir():
        name = entry.name
        if (new / name).exists() or any(re.fullmatch(p, name) for p in owned):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, new / name, symlinks=True, copy_function=_link_or_copy)
        elif entry.is_symlink():
            os.symlink(os.readlink(entry), new / name)
        else:
            _link_or_copy(str(entry), str(new / name))


def _unshare(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors sharing storage; clone any that alias an earlier one."""
    seen: set[int] = set()
    out = {}
    for k, t in tensors.items():
        ptr = t.untyped_storage().data_ptr()
        out[k] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out


def copy_tokenizer_files(src: Union[str, Path], dst: Union[str, Path], *, overwrite_generation_config: bool = True) -> list[str]:
    """Copy tokenizer / processor / chat-template / generation-config files from `src` to `dst`, and the source's
    Python files when a config in `dst` names remote code (`auto_map`, kept from the source)."""
    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise FileNotFoundError(f"copy_from: {src} is not a folder")
    copied = []
    for f in sorted(src.iterdir()):
        if not f.is_file() or not any(re.fullmatch(p, f.name) for p in _TOKENIZER_FILE_PATTERNS):
            continue
        if f.name == "generation_config.json" and not overwrite_generation_config:
            continue
        shutil.copy2(f, dst / f.name)
        copied.append(f.name)
    if _names_remote_code(dst):  # the exported configs keep the source's auto_map: the code it names comes along
        for f in sorted(src.glob("*.py")):
            if f.is_file():
                shutil.copy2(f, dst / f.name)
                copied.append(f.name)
    return copied


def write_pixel_limits(folder: Union[str, Path], *, min_pixels: Optional[int] = None,
                       max_pixels: Optional[int] = None, video_min_pixels: Optional[int] = None,
                       video_max_pixels: Optional[int] = None) -> None:
    """Put the pixel limits a run trained with into the folder's processor configs: preprocessor_config.json
    (images), video_preprocessor_config.json (videos) and the dicts nested in processor_config.json
    ("image_processor" / "video_processor", which transformers reads before either file). Why: transformers and
    vLLM size images and videos by these files; an export holding the source folder's limits gives other token
    counts than training did. Both spellings are written (`size` shortest / longest edge, and top-level
    `min_pixels` / `max_pixels` where the config has them, which transformers lets override `size`). None keeps
    the config's value.

    A folder with no video processor config (older Qwen2.5-VL folders) has its video processor built by
    transformers from preprocessor_config.json, the image one (`BaseVideoProcessor.get_video_processor_dict`;
    the class inferred from its `image_processor_type`), as the data pipeline reads it: changed image limits there
    would resize videos too, and the video limits would be lost. Such a folder gets a video_preprocessor_config.json:
    the source image config as it was, with the video limits."""
    folder = Path(folder)
    image_path, video_path = folder / "preprocessor_config.json", folder / "video_preprocessor_config.json"
    nested_path = folder / "processor_config.json"
    if all(v is None for v in (min_pixels, max_pixels, video_min_pixels, video_max_pixels)):
        return
    nested = json.loads(nested_path.read_text()) if nested_path.is_file() else {}
    if not isinstance(nested, dict):
        nested = {}
    if not video_path.is_file() and not isinstance(nested.get("video_processor"), dict) and image_path.is_file():
        video_path.write_text(image_path.read_text())  # before the image limits change: what the videos had
    for path, lo, hi in ((image_path, min_pixels, max_pixels), (video_path, video_min_pixels, video_max_pixels)):
        if (lo is not None or hi is not None) and path.is_file():
            path.write_text(json.dumps(_with_pixel_limits(json.loads(path.read_text()), lo, hi), indent=2,
                                       sort_keys=True) + "\n")
    changed = False
    for key, lo, hi in (("image_processor", min_pixels, max_pixels), ("video_processor", video_min_pixels,
                                                                      video_max_pixels)):
        if isinstance(nested.get(key), dict) and (lo is not None or hi is not None):
            nested[key] = _with_pixel_limits(nested[key], lo, hi)
            changed = True
    if changed:
        nested_path.write_text(json.dumps(nested, indent=2, sort_keys=True) + "\n")


def _with_pixel_limits(cfg: dict, lo: Optional[int], hi: Optional[int]) -> dict:
    """`cfg` (a processor config) with `lo` / `hi` as its smallest / largest area, in both spellings."""
    cfg = dict(cfg)
    size = dict(cfg.get("size") or {})
    for key, edge, value in (("min_pixels", "shortest_edge", lo), ("max_pixels", "longest_edge", hi)):
        if value is None:
            continue
        size[edge] = int(value)
        for where in (cfg, size):
            if where.get(key) is not None:
                where[key] = int(value)
    cfg["size"] = size
    return cfg


def _names_remote_code(folder: Path) -> bool:
    """Whether a JSON config of `folder` (config.json, tokenizer / processor configs) has an `auto_map`: transformers
    (`trust_remote_code=True`) and vLLM then import the Python modules it names from the folder."""
    for f in folder.glob("*.json"):
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("auto_map"):
            return True
    return False


# ---- crash-safe folder replacement (also used by checkpoint.manager) ----------------------------
# Crash-safe folder replacement for checkpoints and Hugging Face exports.
#
# A folder that readers trust (a `step_<N>` checkpoint, an `hf/` export) is never written in place:
# it is written to a temporary sibling, every file and folder in it is fsynced, and only then put in
# place by renames within the same parent (so on the same filesystem, where `os.replace` is atomic),
# followed by a marker file that is itself written to a temporary name, fsynced and renamed. An
# existing folder of the same name is moved aside first and deleted only after its replacement has
# its marker, so a crash or a full disk at any moment leaves the previous complete folder on disk
# (in place, or under its "old" name, which the next start restores — see `CheckpointManager.cleanup`).


def export_folder(path: Union[str, Path]) -> Path:
    """The folder an export named `path` replaces: the folder a symlink names (so a `hf` linked to shared storage
    is replaced there and the link kept, rather than replaced by a folder beside it), refused before anything is
    written when it exists and is not a folder."""
    path = Path(path)
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{path} exists and is not a folder; an export writes a folder there (remove the "
                                 "file or name another folder)")
    return path


def share_like_umask(folder: Path) -> None:
    """Give the files written into `folder` the mode a plain `open()` would (0666 less the umask, so 0644
    by default): safetensors creates its files 0600, unreadable by the group that shares a cluster folder."""
    mask = os.umask(0)
    os.umask(mask)
    for dirpath, _, filenames in os.walk(str(folder)):
        for name in filenames:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                os.chmod(p, 0o666 & ~mask)


def write_marker(folder: Path, name: str, text: str) -> None:
    """Write `folder/name` atomically and durably: temporary name, fsync, rename, fsync the folder."""
    write_text_durably(folder / name, text)


def replace_dir(tmp: Path, final: Path, old: Path, *, marker: str, marker_text: str,
                is_complete: Callable[[Path], bool]) -> None:
    """Put the fully written folder `tmp` in place as `final` and mark it complete.

    `tmp`, `final` and `old` share one parent. A complete existing `final` (`is_complete`) is moved to
    `old` and deleted only after the new one has its marker; an incomplete one is deleted. An `old`
    left by a crash is put back first when `final` is not complete (it is the last complete one).
    Order: fsync `tmp` -> `final` to `old` -> `tmp` to `final` -> marker -> fsync parent -> delete `old`.
    On an error the new folder is removed and the previous one put back, then the error is raised.
    """
    parent = final.parent
    fsync_tree(tmp)
    if old.exists():
        if final.exists() and is_complete(final):
            shutil.rmtree(old)
        else:
            if final.exists():
                shutil.rmtree(final)
            os.replace(old, final)
    moved = False
    if final.exists():
        if is_complete(final):
            os.replace(final, old)
            moved = True
        else:
            shutil.rmtree(final)
    renamed = False
    try:
        os.replace(tmp, final)
        renamed = True
        write_marker(final, marker, marker_text)
        fsync_dir(parent)
    except BaseException:
        if renamed:
            shutil.rmtree(final, ignore_errors=True)
        if moved and not final.exists():
            os.replace(old, final)
        try:  # noqa: SIM105 -- inside an except block, before the bare raise: keep the plain form
            fsync_dir(parent)
        except OSError:
            pass
        raise
    if moved:
        shutil.rmtree(old, ignore_errors=True)


def describe_error(e: BaseException, folder: Optional[Path] = None) -> str:
    """One line for an error, with a plain-words hint for a full disk / quota. DCP's
    CheckpointException (which holds every failing rank's error) is shortened to those errors.

    `folder`: where the failed write went. DCP sends each rank's error through pickle, which drops the
    OSError that torch's zip writer turned into `RuntimeError: ... unexpected pos ...` (see `_disk_full`), so
    a filesystem with less than `_FULL_BYTES` left under `folder` counts as full too."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = [(r, pair[0] if isinstance(pair, tuple) else pair) for r, pair in sorted(failures.items())]
        text = "; ".join(f"DCP rank {r}: {type(x).__name__}: {x}" for r, x in inner)
        errs = [x for _, x in inner]
    else:
        text = f"{type(e).__name__}: {e}"
        errs = [e]
    text = " ".join(text.split())  # one line
    if any(_disk_full(x) for x in errs) or (folder is not None and _nearly_full(folder)):
        text += " (disk full or quota exceeded)"
    return text


_FULL_BYTES = 1 << 20
"""Free space below which a failed write is put down to a full disk: a write that fails for want of room first
lands the bytes that fit, so the filesystem is left with (nearly) none."""


def _nearly_full(folder: Path) -> bool:
    path = Path(folder)
    while not path.exists() and path != path.parent:  # the folder itself may be gone already
        path = path.parent
    try:
        st = os.statvfs(path)
    except (OSError, AttributeError):  # no statvfs (Windows): no hint
        return False
    return st.f_bavail * st.f_frsize < _FULL_BYTES


def _disk_full(e: BaseException) -> bool:
    """Whether `e`, or an error it was raised from or while handling, is a full disk or quota.

    Why the chain: torch's zip writer (torch.save, DCP's shard writes) turns the file's ENOSPC into
    `RuntimeError: [enforce fail at inline_container.cc] . unexpected pos ...`, the OSError kept only as its
    context."""
    seen: set[int] = set()
    x: Optional[BaseException] = e
    while x is not None and id(x) not in seen:
        if isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen.add(id(x))
        x = x.__cause__ or x.__context__
    return False
