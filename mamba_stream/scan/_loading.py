"""`load_model`: presets and local checkpoints in mamba-ssm or Hugging Face layout."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import mmap
import os
from pathlib import Path
from typing import Any

import torch

from mamba_stream.scan._backends import EXACT_BACKENDS
from mamba_stream.scan._chat import ChatTemplate, ChatTemplateError, NoChatTemplate
from mamba_stream.scan._config import ModelConfig
from mamba_stream.scan._errors import CheckpointError, ConfigError, UnsupportedBackend
from mamba_stream.scan._hf import ARCHITECTURES, is_inf
from mamba_stream.scan._lm import MambaLM
from mamba_stream.scan._model import Model
from mamba_stream.scan._presets import PRESETS, TRAINED_PRESETS, build_preset, initial_weights, trained_preset_dir
from mamba_stream.scan._quant import Q8Weight, quantize_q8
from mamba_stream.scan._transforms import ByteTransform, HFTokenizerTransform

__all__ = [
    "WEIGHT_FORMATS",
    "config_from_json",
    "init_model",
    "load_model",
    "mamba_ssm_config",
    "parameter_shapes",
    "save_checkpoint",
    "weights_revision",
]

log = logging.getLogger(__name__)

# ssm_cfg keys that only shape initialization or training-time kernels: accepted, no effect on
# inference. Any key outside these sets and the understood ones is rejected, so that a
# checkpoint never silently means something we do not compute.
_INIT_ONLY = {
    "Mamba1": {"dt_min", "dt_max", "dt_init", "dt_scale", "dt_init_floor", "use_fast_path", "layer_idx"},
    "Mamba2": {"dt_min", "dt_max", "dt_init_floor", "conv_init", "A_init_range", "use_mem_eff_path",
               "sequence_parallel", "process_group", "layer_idx", "chunk_size"},
    "Mamba3": {"dt_min", "dt_max", "dt_init_floor", "dropout", "layer_idx", "n_layer", "chunk_size"},
}
_UNDERSTOOD = {
    "Mamba1": {"d_state": "d_state", "d_conv": "d_conv", "expand": "expand", "dt_rank": "dt_rank",
               "conv_bias": "conv_bias", "bias": "bias", "bcdt_rms_eps": "bcdt_rms_eps",
               "bcdt_norm_weights": "bcdt_norm_weights"},
    "Mamba2": {"d_state": "d_state", "d_conv": "d_conv", "expand": "expand", "headdim": "headdim",
               "d_ssm": "d_ssm", "ngroups": "ngroups", "D_has_hdim": "D_has_hdim", "rmsnorm": "rmsnorm",
               "norm_before_gate": "norm_before_gate", "bias": "bias", "conv_bias": "conv_bias"},
    "Mamba3": {"d_state": "d_state", "expand": "expand", "headdim": "headdim", "ngroups": "ngroups",
               "rope_fraction": "rope_fraction", "A_floor": "A_floor",
               "is_outproj_norm": "is_outproj_norm", "mimo_rank": "mimo_rank"},
}
_ARCH_OF_LAYER = {"Mamba1": "mamba1", "Mamba2": "mamba2", "Mamba3": "mamba3"}

#: The formats a model's matrices (the projections, the embedding, the head) can be held in, by
#: `load_model(weights=...)`, with their torch dtype ("q8": block-int8, `scan._quant`): the exact
#: backend reads them as they are; the other parameters (norms, conv taps, A, D, biases: a few MB)
#: are held in the compute dtype.
WEIGHT_FORMATS: dict[str, torch.dtype | None] = {
    "float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "q8": None,
}
#: formats narrower than any computation: read as stored by the exact backend only
_NARROW = ("bfloat16", "float16", "q8")
_DTYPE_NAMES = {v: k for k, v in WEIGHT_FORMATS.items() if v is not None}
#: safetensors' dtype names
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


def _from_mamba_ssm(cfg: dict[str, Any]) -> dict[str, Any]:
    if cfg.get("d_intermediate", 0):
        raise ConfigError("MLP blocks (d_intermediate > 0) are not supported", field="d_intermediate")
    if cfg.get("attn_layer_idx"):
        raise ConfigError("attention layers are not supported", field="attn_layer_idx")
    ssm = dict(cfg.get("ssm_cfg") or {})
    layer = ssm.pop("layer", "Mamba1")
    if layer not in _ARCH_OF_LAYER:
        raise ConfigError(f"unknown layer {layer!r}; expected Mamba1, Mamba2 or Mamba3", field="ssm_cfg.layer")
    fields: dict[str, Any] = {
        "architecture": _ARCH_OF_LAYER[layer],
        "d_model": cfg["d_model"],
        "n_layer": cfg["n_layer"],
        "vocab_size": cfg["vocab_size"],
        "pad_vocab_size_multiple": cfg.get("pad_vocab_size_multiple", 8),
        "tie_embeddings": cfg.get("tie_embeddings", True),
        "rms_norm": cfg.get("rms_norm", True),
        "residual_in_fp32": cfg.get("residual_in_fp32", True),
        "norm_eps": cfg.get("norm_epsilon", 1e-5),
    }
    if layer == "Mamba1" and ssm.get("dt_rank", "auto") == "auto":
        ssm.pop("dt_rank", None)
    if layer == "Mamba2" and "dt_limit" in ssm:
        lo, hi = ssm.pop("dt_limit")
        fields["dt_min_clamp"] = float(lo)
        fields["dt_max_clamp"] = None if is_inf(hi) else float(hi)
    if layer == "Mamba3":
        is_mimo = ssm.pop("is_mimo", False)
        rank = ssm.pop("mimo_rank", 4)
        if is_mimo and rank < 2:
            raise ConfigError("is_mimo with mimo_rank < 2 is not supported", field="ssm_cfg.mimo_rank")
        ssm["mimo_rank"] = rank if is_mimo else 1
    for key, value in ssm.items():
        if key in _UNDERSTOOD[layer]:
            fields[_UNDERSTOOD[layer][key]] = value
        elif key not in _INIT_ONLY[layer]:
            raise ConfigError(f"unsupported {layer} option {key}={value!r}", field=f"ssm_cfg.{key}")
    return fields


def _from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    mt = cfg["model_type"]
    if mt in ARCHITECTURES:
        return ARCHITECTURES[mt].fields(cfg)
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ConfigError(f"activation {cfg['hidden_act']!r} is not supported", field="hidden_act")
    eps = cfg.get("layer_norm_epsilon", 1e-5)
    fields: dict[str, Any] = {
        "d_model": cfg["hidden_size"],
        "n_layer": cfg["num_hidden_layers"],
        "vocab_size": cfg["vocab_size"],
        "pad_vocab_size_multiple": 1,
        "d_state": cfg.get("state_size", 16 if mt in ("mamba", "falcon_mamba") else 128),
        "d_conv": cfg.get("conv_kernel", 4),
        "expand": cfg.get("expand", 2),
        "bias": cfg.get("use_bias", False),
        "conv_bias": cfg.get("use_conv_bias", True),
        "norm_eps": eps,
        "residual_in_fp32": cfg.get("residual_in_fp32", True),
    }
    if mt in ("mamba", "falcon_mamba"):
        # FalconMamba is HF's Mamba with the same tensor names and config fields, plus the
        # weightless dt/B/C norms (`mixer_rms_eps`, FalconMambaConfig's default 1e-6)
        fields["architecture"] = "mamba1"
        fields["tie_embeddings"] = cfg.get("tie_word_embeddings", True)
        rank = cfg.get("time_step_rank", "auto")
        fields["dt_rank"] = None if rank == "auto" else int(rank)
        if mt == "falcon_mamba":
            fields["bcdt_rms_eps"] = cfg.get("mixer_rms_eps", 1e-6)
    elif mt == "mamba2":
        fields["architecture"] = "mamba2"
        fields["tie_embeddings"] = cfg.get("tie_word_embeddings", False)
        fields["headdim"] = cfg.get("head_dim", 64)
        fields["ngroups"] = cfg.get("n_groups", 1)
        fields["mixer_norm_eps"] = eps
        fields["norm_before_gate"] = False
        lo, hi = cfg.get("time_step_limit", (0.0, float("inf")))
        fields["dt_min_clamp"] = float(lo)
        fields["dt_max_clamp"] = None if is_inf(hi) else float(hi)
        d_inner = int(fields["expand"] * fields["d_model"])
        if "num_heads" in cfg and cfg["num_heads"] * fields["headdim"] != d_inner:
            raise ConfigError(
                f"num_heads={cfg['num_heads']} * head_dim={fields['headdim']} != expand * hidden_size={d_inner}",
                field="num_heads",
            )
    else:
        known = ", ".join(repr(t) for t in ("mamba", "falcon_mamba", "mamba2", *sorted(ARCHITECTURES)))
        raise ConfigError(f"unsupported model_type {mt!r}; expected one of {known}", field="model_type")
    return fields


def config_from_json(cfg: dict[str, Any]) -> tuple[ModelConfig, str]:
    """A ModelConfig from a mamba-ssm or Hugging Face config.json; returns (config, layout)."""
    try:
        if "model_type" in cfg and "hidden_size" in cfg:
            return ModelConfig.create(**_from_hf(cfg)), "hf"
        if "d_model" in cfg:
            return ModelConfig.create(**_from_mamba_ssm(cfg)), "mamba-ssm"
    except KeyError as exc:
        raise ConfigError("required field is missing", field=str(exc.args[0])) from None
    raise ConfigError("neither a mamba-ssm (d_model) nor a Hugging Face (model_type, hidden_size) config",
                      field="config.json")


def _map_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file as views of one private (copy-on-write) mapping of it:
    nothing is read until it is used, and the pages are the file's, shared with the page cache."""
    size = path.stat().st_size
    with path.open("rb") as fh:
        if size < 8:
            raise CheckpointError(f"{path}: {size} bytes is not a safetensors file")
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
    n = int.from_bytes(mapped[:8], "little")
    if n > size - 8:
        raise CheckpointError(f"{path}: a header of {n} bytes does not fit a {size}-byte file")
    try:
        header = json.loads(bytes(mapped[8 : 8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: the header is not JSON: {exc}") from exc
    base, out = 8 + n, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = _ST_DTYPES[info["dtype"]], [int(d) for d in info["shape"]], info["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: tensor {name!r} has an unreadable entry ({exc})") from exc
        count = math.prod(shape)
        if not (0 <= b <= e <= size - base) or e - b != count * dtype.itemsize:
            raise CheckpointError(f"{path}: tensor {name!r} does not fit its byte range [{b}, {e})")
        if count == 0:
            out[name] = torch.empty(shape, dtype=dtype)
        elif (base + b) % dtype.itemsize:  # a misaligned tensor (files written by hand): a copy
            out[name] = torch.frombuffer(bytearray(mapped[base + b : base + e]), dtype=dtype).reshape(shape)
        else:
            out[name] = torch.frombuffer(mapped, dtype=dtype, count=count, offset=base + b).reshape(shape)
    return out


_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "config.json")


#: a file modified this recently may be written again within one tick of the file system's clock,
#: under the same size, time and inode: its key is not trusted yet (git's "racy" files)
_SETTLED_S = 2.0


def _files_key(directory: Path) -> str | None:
    """What identifies a checkpoint directory's bytes without reading them: each weight file's
    path, size, modification and change times and inode (None where there is nothing to key on,
    or a file was modified in the last `_SETTLED_S` seconds)."""
    import time

    parts = []
    files = [directory / f for f in _WEIGHT_FILES if (directory / f).exists()]
    index = directory / "model.safetensors.index.json"
    if index.exists():
        try:
            files += sorted({directory / f for f in json.loads(index.read_text())["weight_map"].values()})
        except (OSError, ValueError, KeyError):
            return None
    now = time.time()
    for f in files:
        st = f.stat()
        if now - max(st.st_mtime, st.st_ctime) < _SETTLED_S:
            return None
        parts.append(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{st.st_ino}")
    return hashlib.sha256("\n".join(["revision/v1", *parts]).encode()).hexdigest() if parts else None


def _revision_of(directory: Path, sd: dict[str, Any]) -> str:
    """`weights_revision(sd)`, remembered by the files' identity (`_files_key`) under the cache
    directory: hashing a 14 GB checkpoint takes seconds on every load otherwise. A file written
    again changes its modification time and so its key; the cache is the worker's own, beside its
    compiled kernels ($MAMBA_STREAM_CACHE)."""
    from mamba_stream.scan.exact import cache_dir

    key = _files_key(directory)
    entry = cache_dir() / "revisions" / f"{key}.txt" if key else None
    if entry is not None and entry.is_file():
        text = entry.read_text().strip()
        if text.startswith("sha256:") and len(text) == 71:
            return text
    revision = weights_revision(sd)
    if entry is not None:
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            tmp = entry.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(revision + "\n")
            os.replace(tmp, entry)
        except OSError as exc:  # a read-only cache costs the hash, nothing else
            log.info("revision cache not written: %s", exc)
    return revision


def _weight_files(directory: Path) -> list[Path]:
    """The files a checkpoint directory's weights are read from, in the order `_read_weights`
    looks: model.safetensors, else the shards model.safetensors.index.json names, else
    pytorch_model.bin. Raises CheckpointError where there are none, or the index is unreadable."""
    st = directory / "model.safetensors"
    index = directory / "model.safetensors.index.json"
    if st.exists():
        return [st]
    if index.exists():
        try:
            return sorted({directory / f for f in json.loads(index.read_text())["weight_map"].values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index} has no readable weight_map: {exc!r}") from exc
    binf = directory / "pytorch_model.bin"
    if binf.exists():
        return [binf]
    raise CheckpointError(f"{directory} holds no model.safetensors or pytorch_model.bin")


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    files = _weight_files(directory)
    if files[0].name != "pytorch_model.bin":
        out: dict[str, torch.Tensor] = {}
        for f in files:
            out.update(_map_safetensors(f))
        return out
    binf = files[0]
    try:
        sd = torch.load(binf, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        raise CheckpointError(f"{binf}: cannot be loaded with weights_only=True: {exc}") from exc
    if not isinstance(sd, dict):
        raise CheckpointError(f"{binf} does not hold a state dict")
    return sd


def checkpoint_problem(source: str | Path, weights: str | None = None) -> str | None:
    """What keeps `load_model(source, weights=weights)` from loading, as far as the names, the
    config.json and the weight files' presence tell, without reading a weight (a worker checks
    its models with it before it starts); None where nothing is found. A file whose bytes are
    damaged is found only by the load."""
    if weights is not None and weights not in WEIGHT_FORMATS:
        return f"unknown weight format {weights!r}; expected one of {sorted(WEIGHT_FORMATS)}"
    name = str(source)
    if name in PRESETS:
        return None
    directory = trained_preset_dir(name) if name in TRAINED_PRESETS else Path(source)
    if not directory.exists():
        if name in TRAINED_PRESETS:
            return f"the trained preset's files are missing under {directory}"
        return f"no such preset ({', '.join(sorted([*PRESETS, *TRAINED_PRESETS]))}) or directory"
    if not directory.is_dir():
        return "not a checkpoint directory"
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        return "no config.json in the directory"
    try:
        raw = json.loads(cfg_path.read_text())
    except OSError as exc:
        return f"config.json cannot be read: {exc.strerror or exc}"
    except ValueError as exc:
        return f"config.json is not valid JSON: {exc}"
    if not isinstance(raw, dict):
        return "config.json is not a JSON object"
    try:
        config_from_json(raw)
        files = _weight_files(directory)
    except (ConfigError, CheckpointError) as exc:
        return f"config.json: {exc}" if isinstance(exc, ConfigError) else str(exc)
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        return f"model.safetensors.index.json names shards that are not there: {missing[:4]}"
    unreadable = [f.name for f in files if not os.access(f, os.R_OK)]
    if unreadable:
        return f"weight files not readable by this user: {unreadable[:4]}"
    return None


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter a checkpoint of `cfg` holds, with its shape, by mamba-ssm name (a tied head
    is left out: the embedding is the head)."""
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in MambaLM(cfg).state_dict().items()}
    if cfg.tie_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def _fold_q8(sd: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """`<name>_q8` and `<name>_scale` pairs as one Q8Weight under `<name>`."""
    out: dict[str, Any] = {k: v for k, v in sd.items() if not k.endswith(("_q8", "_scale"))}
    for k in sd:
        if not k.endswith("_q8"):
            continue
        name, scale = k[: -len("_q8")], k[: -len("_q8")] + "_scale"
        if scale not in sd or name not in expected or name in sd:
            raise CheckpointError(f"{k}: a q8 matrix needs {scale} and a parameter {name} held in no other form")
        try:
            out[name] = Q8Weight(sd[k], sd[scale], expected[name][-1])
        except ValueError as exc:
            raise CheckpointError(f"{k}: {exc}") from None
    stray = [k for k in sd if k.endswith("_scale") and k[: -len("_scale")] + "_q8" not in sd]
    if stray:
        raise CheckpointError(f"unexpected tensors: {stray[:8]}")
    return out


def _canonical_weights(sd: dict[str, torch.Tensor], cfg: ModelConfig, model_type: str | None = None) -> dict[str, Any]:
    """Rename to mamba-ssm names (a hybrid's by its architecture, `scan._hf`), fold q8 pairs and the
    tied head, check names and shapes against `cfg`."""
    sd = {k.replace("backbone.embeddings.weight", "backbone.embedding.weight"): v for k, v in sd.items()}
    if model_type in ARCHITECTURES:
        sd = ARCHITECTURES[model_type].tensors(sd, cfg)
    full = parameter_shapes(cfg)
    if cfg.tie_embeddings:
        full["lm_head.weight"] = full["backbone.embedding.weight"]
    sd = _fold_q8(sd, full)
    if cfg.tie_embeddings and "lm_head.weight" in sd:
        head = sd.pop("lm_head.weight")
        emb = sd.get("backbone.embedding.weight")
        same = emb is not None and head.shape == emb.shape and (
            torch.equal(head.q, emb.q) and torch.equal(head.d, emb.d) if isinstance(head, Q8Weight)
            and isinstance(emb, Q8Weight) else not isinstance(head, Q8Weight) and not isinstance(emb, Q8Weight)
            and torch.equal(head, emb))
        if not same:
            raise CheckpointError("tie_embeddings is set but lm_head.weight differs from the embedding")
    expected = parameter_shapes(cfg)
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(set(sd) - set(expected))
    if missing:
        raise CheckpointError(f"missing tensors: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        raise CheckpointError(f"unexpected tensors: {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    for k, shape in expected.items():
        if tuple(sd[k].shape) != shape:
            raise CheckpointError(f"{k} has shape {tuple(sd[k].shape)}, the config implies {shape}")
        if not isinstance(sd[k], Q8Weight) and not sd[k].dtype.is_floating_point:
            raise CheckpointError(f"{k} has dtype {sd[k].dtype}, expected a floating-point tensor")
    return sd


def _revision_items(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The tensors a revision covers: a q8 matrix as the two tensors a file holds it in."""
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if isinstance(t, Q8Weight):
            out[name + "_q8"], out[name + "_scale"] = t.q, t.d
        else:
            out[name] = t
    return out


def weights_revision(sd: dict[str, Any]) -> str:
    """`sha256:<hex>` over sorted (name, dtype, shape, bytes): the identity of a set of weights."""
    h = hashlib.sha256()
    items = _revision_items(sd)
    for name in sorted(items):
        t = items[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # the buffer itself: no copy of a mapped file
    return "sha256:" + h.hexdigest()


def _matrices(lm: MambaLM) -> set[str]:
    """The names of the parameters held in the weight format: every product's weight and the embedding."""
    return {f"{name}.weight" for name, mod in lm.named_modules()
            if isinstance(mod, (torch.nn.Linear, torch.nn.Embedding))}


def _stored_format(t: Any) -> str:
    return "q8" if isinstance(t, Q8Weight) else _DTYPE_NAMES.get(t.dtype, str(t.dtype))


def _weight_format(weights: str | None, sd: dict[str, Any], cfg: ModelConfig, dtype: torch.dtype,
                   reads_stored: bool) -> str:
    """The format the matrices are held in. None: as stored when that is narrower (bfloat16,
    float16, q8) and the backend reads stored weights (exact), else the compute dtype."""
    compute = _DTYPE_NAMES[dtype]
    if weights is None:
        with torch.device("meta"):
            names = _matrices(MambaLM(cfg))
        stored = {_stored_format(sd[k]) for k in names if k in sd}
        if reads_stored and len(stored) == 1 and next(iter(stored)) in _NARROW:
            weights = next(iter(stored))
            return weights if weights != "q8" or dtype == torch.float32 else compute
        return compute
    if weights not in WEIGHT_FORMATS:
        raise UnsupportedBackend(f"unknown weight format {weights!r}; expected one of {sorted(WEIGHT_FORMATS)}")
    if weights != compute and weights not in _NARROW:
        raise UnsupportedBackend(f"{weights} weights with {dtype} computation: weights are held in the compute "
                                 "dtype or narrower (bfloat16, float16, q8)")
    if weights == "q8" and dtype != torch.float32:
        raise UnsupportedBackend(f"q8 products compute in float32, not {dtype}")
    if weights != compute and not reads_stored:
        raise UnsupportedBackend(f"{weights} weights are read as they are by the exact backend only")
    return weights


def _held(v: Any, fmt: str, device: torch.device, kept: bool) -> Any:
    """A matrix in format `fmt`: as it is when `kept` allows and it is already so, else converted."""
    if fmt == "q8":
        return v if isinstance(v, Q8Weight) else quantize_q8(v)
    if isinstance(v, Q8Weight):
        v = v.dequantize()
    want = WEIGHT_FORMATS[fmt]
    return v if kept and v.dtype == want and v.device == device else v.to(device=device, dtype=want, copy=True)


def _build(cfg: ModelConfig, sd: dict[str, Any], dtype: torch.dtype, device: torch.device,
           weights: str | None = None, *, mapped: bool = False) -> MambaLM:
    """The module, its matrices in format `weights` (default: the compute dtype), its other
    parameters in `dtype`.

    `mapped`: `sd` holds views of the checkpoint's files, which a tensor already in its target
    dtype and device keeps (no copy); otherwise every tensor is copied, so that the module never
    shares storage with a caller's dict."""
    fmt = weights or _DTYPE_NAMES[dtype]
    if fmt == "q8" and device.type != "cpu":
        raise UnsupportedBackend("q8 weights are served on the CPU")
    with torch.device("meta"):
        lm = MambaLM(cfg)
    matrices = _matrices(lm)
    params: dict[str, torch.Tensor] = {}
    quantized: dict[str, Q8Weight] = {}  # q8 matrices: not parameters, installed below
    held_in = quantized if fmt == "q8" else params
    for k, v in sd.items():
        if k in matrices:
            held_in[k] = _held(v, fmt, device, mapped)
        else:
            kept = mapped and v.dtype == dtype and v.device == device
            params[k] = v if kept else v.to(device=device, dtype=dtype, copy=True)
    tied = cfg.tie_embeddings
    if tied:
        held_in["lm_head.weight"] = held_in["backbone.embedding.weight"]
    missing, unexpected = lm.load_state_dict(params, assign=True, strict=False)
    if unexpected or set(missing) != set(quantized):
        raise CheckpointError(f"the module's parameters do not match: missing {sorted(set(missing) - set(quantized))}, "
                              f"unexpected {sorted(unexpected)}")
    for name, qw in quantized.items():
        mod = lm.get_submodule(name.rsplit(".", 1)[0])
        del mod._parameters["weight"]
        mod.register_buffer("weight_q8", qw.q)
        mod.register_buffer("weight_scale", qw.d)
        object.__setattr__(mod, "weight", qw)
    if tied and fmt != "q8":
        lm.lm_head.weight = lm.backbone.embedding.weight
    for p in lm.parameters():
        p.requires_grad_(False)
    return lm.eval()


#: checkpoint directories already warned about having no tokenizer.json (once per model and
#: process: a worker loads its models once, but tests and tools load the same one again)
_WARNED_NO_TOKENIZER: set[Path] = set()


def _warn_no_tokenizer(directory: Path, vocab: int) -> None:
    key = directory.resolve()
    if key in _WARNED_NO_TOKENIZER:
        return
    _WARNED_NO_TOKENIZER.add(key)
    if vocab >= 256:
        log.warning("checkpoint %s has no tokenizer.json: its text is read as UTF-8 bytes (token ids 0-255 of "
                    "its %d-token vocabulary); put the tokenizer.json it was trained with beside its config.json "
                    "for its own tokenizer", directory, vocab)
    else:
        log.warning("checkpoint %s has no tokenizer.json and a %d-token vocabulary, too small for bytes: it takes "
                    "token ids only, no text", directory, vocab)


def _eos_ids_of(value: Any, where: str) -> tuple[int, ...] | None:
    """An `eos_token_id` entry (an id, or a list of ids as Hugging Face allows); None: absent."""
    if value is None:
        return None
    ids = value if isinstance(value, list) else [value]
    if not ids or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise ConfigError(f"{value!r} in {where} is not a token id nor a list of them", field="eos_token_id")
    return tuple(ids)


def _eos_token_ids(directory: Path, raw: dict[str, Any], transform: Any) -> tuple[int, ...]:
    """The checkpoint's end-of-sequence ids: config.json's `eos_token_id`, else
    generation_config.json's (Hugging Face keeps it there too), else its tokenizer's; () if none.
    (`Model` checks that they are ids of its vocabulary.)"""
    found = _eos_ids_of(raw.get("eos_token_id"), "config.json")
    gen = directory / "generation_config.json"
    if found is None and gen.is_file():
        try:
            found = _eos_ids_of(json.loads(gen.read_text()).get("eos_token_id"), "generation_config.json")
        except (json.JSONDecodeError, AttributeError) as exc:
            raise ConfigError(f"generation_config.json is not a JSON object: {exc}", field="eos_token_id") from exc
    if found is None and getattr(transform, "eos_token_id", None) is not None:
        found = (transform.eos_token_id,)
    return found or ()


def load_model(
    source: str | Path,
    *,
    backend: str = "auto",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    state_dtype: torch.dtype | None = None,
    weights: str | None = None,
    max_positions: int | None = None,
) -> Model:
    """Load a preset by name, or a checkpoint directory (mamba-ssm or Hugging Face layout).

    Args:
        source: a preset name (`scan.PRESETS`, built from a seed; `scan.TRAINED_PRESETS`, shipped
            weights) or a directory with config.json and
            model.safetensors (memory-mapped) or pytorch_model.bin (loaded with weights_only).
        backend: "auto" (exact on a CPU, triton on CUDA), "exact", "exact-fma" (the exact arithmetic
            with fused multiply-adds in the products: exact-2), "reference", "chunked" or "triton".
        dtype: torch.float32 or torch.float64, for weights and computation.
        device: where the weights and states live.
        state_dtype: the dtype of the state; by default `dtype`. bfloat16 or float16 round the
            state after every token (reference backend only) and are recorded in the schema.
        weights: the format the matrices are held and read in (`WEIGHT_FORMATS`): "bfloat16" or
            "float16" keep (or round to) 2 bytes a weight, which the exact kernels widen as they
            read (exactly: the bits of the same values held in float32); "float32"/"float64" the
            compute dtype. By default a bfloat16 or float16 checkpoint is kept as stored on the
            exact backend (memory-mapped, no copy) and widened for the others. A format narrower
            than the computation is recorded in the schema and the arithmetic: a receipt made
            under one format does not resume under another.
        max_positions: a model with attention layers: the positions a stream may reach (its KV
            rows), at most the checkpoint's `max_position_embeddings` (the default). A stream's
            state holds this many KV rows per attention layer, so a long-context checkpoint
            (Granite-4.0-H: 131,072 positions, 2.1 GB of float32 KV a stream at its Micro size)
            is served with the bound its streams need. Part of the schema: a state made under one
            bound does not resume under another.

    A checkpoint directory's text transform is its tokenizer.json; without one, UTF-8 bytes (a
    warning is logged, once per directory), or none for a vocabulary under 256 ids. Its
    end-of-sequence ids (`Model.eos_token_ids`, where a generation stops) are config.json's
    `eos_token_id` (an id or a list), else generation_config.json's, else the tokenizer's
    (`HFTokenizerTransform.eos_token_id`); the presets have none. Its chat template
    (`Model.chat_template`) is the directory's (`ChatTemplate.from_directory`: chat_template.jinja,
    else tokenizer_config.json's `chat_template`); the presets, built and trained, have the
    documented plain one (`PLAIN_CHAT_TEMPLATE`, docs/chat-templates.md), made for their byte
    vocabulary. A directory without a template, or with one that does not compile, still loads:
    `Model.chat_template` raises why.

    Raises:
        ConfigError naming the offending config field (`eos_token_id` included: not an id of
        the vocabulary; `max_positions`: not an attention model's, or past its checkpoint's);
        CheckpointError for missing or mismatched tensors; UnsupportedBackend for an unknown
        backend or dtype.
    """
    device = torch.device(device)
    name = str(source)
    if name in PRESETS:
        cfg, sd = build_preset(name)
        transform: Any = ByteTransform()
        model_id = name
        eos: tuple[int, ...] = ()  # the presets' byte vocabulary has no end-of-sequence token
        chat: ChatTemplate | ChatTemplateError = ChatTemplate.plain()
    else:
        directory = trained_preset_dir(name) if name in TRAINED_PRESETS else Path(source)
        cfg_path = directory / "config.json"
        if not cfg_path.is_file():
            if name in TRAINED_PRESETS:
                raise CheckpointError(f"trained preset {name!r} is missing its files under {directory}")
            names = ", ".join(sorted([*PRESETS, *TRAINED_PRESETS]))
            raise CheckpointError(f"{source!r} is neither a preset ({names}) nor a directory with config.json")
        try:
            raw = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"invalid JSON: {exc}", field="config.json") from exc
        cfg, layout = config_from_json(raw)
        sd = _canonical_weights(_read_weights(directory), cfg, raw.get("model_type") if layout == "hf" else None)
        tok = directory / "tokenizer.json"
        transform = HFTokenizerTransform(tok) if tok.exists() else (
            ByteTransform() if cfg.padded_vocab_size >= 256 else None
        )
        if not tok.exists() and name not in TRAINED_PRESETS:  # the shipped presets read bytes by design
            _warn_no_tokenizer(directory, cfg.padded_vocab_size)
        eos = _eos_token_ids(directory, raw, transform)
        chat = ChatTemplate.plain() if name in TRAINED_PRESETS else _chat_template_of(directory)
        model_id = directory.resolve().name
        log.info("loaded %s checkpoint %s (%s)", layout, directory, cfg.architecture)
    if max_positions is not None:
        cfg = _bounded(cfg, max_positions)
    revision = weights_revision(sd) if name in PRESETS else _revision_of(directory, sd)
    reads_stored = backend in EXACT_BACKENDS or (backend == "auto" and device.type == "cpu")
    fmt = _weight_format(weights, sd, cfg, dtype, reads_stored)
    # the exact kernels' bits do not depend on where a weight lies; torch's kernels may (a vector
    # loop peels to alignment), so the other backends get fresh, aligned copies as they always did
    mapped = name not in PRESETS and reads_stored
    lm = _build(cfg, sd, dtype, device, fmt, mapped=mapped)
    model = Model(lm, model_id=model_id, revision=revision, backend=backend, transform=transform,
                  state_dtype=state_dtype, eos_token_ids=eos, chat_template=chat)
    if mapped and fmt == "q8":
        # the file's q8 matrices, in use as they are: their scales leave memory once repacked
        # (the kernels read the repacked copy only), after the probe has run
        stored = {id(w): w for w in sd.values() if isinstance(w, Q8Weight)}
        released = sum(w.settle() for w in stored.values())
        log.debug("q8 scales paged out after repacking: %d bytes", released)
    return model


def _chat_template_of(directory: Path) -> ChatTemplate | ChatTemplateError:
    """A checkpoint directory's chat template, or why it has none (kept for `Model.chat_template`
    to raise: a model is served token by token without one)."""
    try:
        return ChatTemplate.from_directory(directory)
    except NoChatTemplate as exc:
        log.info("%s", exc)
        return exc
    except ChatTemplateError as exc:
        log.warning("checkpoint %s: its chat template is refused: %s", directory, exc)
        return exc


def _bounded(cfg: ModelConfig, max_positions: int) -> ModelConfig:
    """`cfg` with its streams' position bound lowered to `max_positions` (checked, typed)."""
    if cfg.max_positions is None:
        raise ConfigError("the model has no attention layer: there is no position bound to set", field="max_positions")
    whole = isinstance(max_positions, int) and not isinstance(max_positions, bool)
    if not whole or not 1 <= max_positions <= cfg.max_positions:
        raise ConfigError(f"must be an integer in [1, {cfg.max_positions}] (the checkpoint's max_position_embeddings), "
                          f"got {max_positions!r}", field="max_positions")
    return cfg.model_copy(update={"max_positions": max_positions})


def init_model(
    config: ModelConfig,
    seed: int = 0,
    *,
    backend: str = "auto",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    model_id: str | None = None,
    state_dtype: torch.dtype | None = None,
    weights: str | None = None,
) -> Model:
    """A freshly initialized model (mamba-ssm-style init, deterministic in `seed`); `weights` as
    for `load_model` (the initial weights are float32: "bfloat16" rounds them). A hybrid's attention,
    MLP, expert and parallel layers have recipes too (`scan._init`); Zamba2's weight-shared blocks
    have none (ConfigError, field `layer_types`)."""
    if "shared" in config.kinds:
        raise ConfigError("Zamba2's weight-shared blocks (\"shared\" layers) have no initialization here: load a "
                          "checkpoint", field="layer_types")
    sd = initial_weights(config, seed)
    device = torch.device(device)
    reads_stored = backend in EXACT_BACKENDS or (backend == "auto" and device.type == "cpu")
    built = _build(config, sd, dtype, device, _weight_format(weights, sd, config, dtype, reads_stored))
    transform = ByteTransform() if config.padded_vocab_size >= 256 else None
    return Model(built, model_id=model_id or f"init-{config.architecture}-seed{seed}",
                 revision=weights_revision(sd), backend=backend, transform=transform, state_dtype=state_dtype)


def mamba_ssm_config(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json mamba-ssm's MambaLMHeadModel reads for the same model (a hybrid has none:
    CheckpointError)."""
    if cfg.is_hybrid:
        raise CheckpointError("a hybrid model (attention layers, MLP sublayers, multipliers) has no mamba-ssm "
                              "config.json; save_checkpoint does not write hybrids yet: keep its Hugging Face "
                              "directory")
    layer = {"mamba1": "Mamba1", "mamba2": "Mamba2", "mamba3": "Mamba3"}[cfg.architecture]
    ssm: dict[str, Any] = {"layer": layer, "d_state": cfg.d_state, "expand": cfg.expand}
    if cfg.architecture == "mamba1":
        ssm.update(d_conv=cfg.d_conv, dt_rank=cfg.resolved_dt_rank, conv_bias=cfg.conv_bias, bias=cfg.bias)
        if cfg.bcdt_rms_eps is not None:
            # not a mamba-ssm option: its Mamba(**ssm_cfg) refuses the key, where leaving it out
            # would have it load a FalconMamba as a plain Mamba-1 (another function)
            ssm["bcdt_rms_eps"] = cfg.bcdt_rms_eps
        if cfg.bcdt_norm_weights:  # the norms' learned weights (Jamba's): their tensors need the key
            ssm["bcdt_norm_weights"] = True
    elif cfg.architecture == "mamba2":
        ssm.update(
            d_conv=cfg.d_conv, headdim=cfg.headdim, ngroups=cfg.ngroups, d_ssm=cfg.d_ssm,
            D_has_hdim=cfg.D_has_hdim, rmsnorm=cfg.rmsnorm, norm_before_gate=cfg.norm_before_gate,
            conv_bias=cfg.conv_bias, bias=cfg.bias,
        )
        if cfg.dt_min_clamp > 0.0 or cfg.dt_max_clamp is not None:
            hi = float("inf") if cfg.dt_max_clamp is None else cfg.dt_max_clamp
            ssm["dt_limit"] = [cfg.dt_min_clamp, hi]
    else:
        ssm.update(
            headdim=cfg.headdim, ngroups=cfg.ngroups, rope_fraction=cfg.rope_fraction, A_floor=cfg.A_floor,
            is_outproj_norm=cfg.is_outproj_norm, is_mimo=cfg.mimo_rank > 1, mimo_rank=cfg.mimo_rank,
        )
    out = {
        "d_model": cfg.d_model, "d_intermediate": 0, "n_layer": cfg.n_layer, "vocab_size": cfg.vocab_size,
        "ssm_cfg": ssm, "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": cfg.rms_norm,
        "residual_in_fp32": cfg.residual_in_fp32, "fused_add_norm": False,
        "pad_vocab_size_multiple": cfg.pad_vocab_size_multiple, "tie_embeddings": cfg.tie_embeddings,
    }
    if cfg.norm_eps != 1e-5:  # not a MambaConfig field: written only when it matters
        out["norm_epsilon"] = cfg.norm_eps
    return out


def save_checkpoint(model: Model, directory: str | Path) -> Path:
    """Write `model` in mamba-ssm layout: config.json + model.safetensors (tied head omitted; q8
    matrices as `<name>_q8` and `<name>_scale`, read back as q8). A hybrid is refused
    (CheckpointError) before anything is written."""
    from safetensors.torch import save_file

    cfg = mamba_ssm_config(model.config)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to("cpu").contiguous() for k, v in model.module.state_dict().items()}
    if model.config.tie_embeddings:
        for name in ("lm_head.weight", "lm_head.weight_q8", "lm_head.weight_scale"):
            sd.pop(name, None)
    if model.eos_token_ids:  # only where there is one: mamba-ssm's own MambaConfig takes no such field
        cfg["eos_token_id"] = model.eos_token_ids[0] if len(model.eos_token_ids) == 1 else list(model.eos_token_ids)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(sd, str(out / "model.safetensors"))
    return out
