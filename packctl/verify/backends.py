"""Varlen attention backends for `packctl verify`: the kernels trainers run over packed THD tokens.

Every backend computes causal attention over the flat tokens of one pack, each sequence seeing
only itself, with the boundaries a trainer would pass (`cu_seqlens_padded`):

    q, k, v: (T, H, D) tensors      cu_seqlens_padded [0, 8, 16] (int32)     -> out (T, H, D)

    allowed keys (x) for T = 6, cu_seqlens_padded [0, 2, 6]:
              k0 k1 | k2 k3 k4 k5
        q0    x     |
        q1    x  x  |
        q2          | x
        q3          | x  x
        q4          | x  x  x
        q5          | x  x  x  x

| name | kernel | device | dtypes |
|---|---|---|---|
| `flash-attn` | `flash_attn_varlen_func` (FlashAttention 2, or 4's `flash_attn.cute`) | cuda | fp16, bf16 |
| `torch-varlen` | `torch.nn.attention.varlen.varlen_attn` (torch >= 2.10) | cuda | fp16, bf16 |
| `flex` | `flex_attention` with a document-causal block mask (compiled on CUDA, eager on CPU) | cpu, cuda | all |
| `sdpa` | `scaled_dot_product_attention` with a block-diagonal causal mask | cpu, cuda | all |

torch and flash-attn are optional: they are imported when a backend is built, and a missing one
fails with its `pip install` line.
"""
from __future__ import annotations

import importlib.util
import inspect
import warnings
from typing import Any

import numpy as np

from packctl.errors import PackctlError, require

BACKENDS = ("flash-attn", "torch-varlen", "flex", "sdpa")
DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
          "fp16": "float16", "float16": "float16"}
DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
PURPOSE = "packctl verify's attention check"


def import_torch():
    """torch, or MissingExtraError with `pip install 'packctl[torch]'`."""
    return require("torch", "torch", PURPOSE)


def resolve_device(device: str) -> str:
    """`auto` -> cuda when torch sees a GPU, else cpu; `cuda` without a GPU is an error."""
    torch = import_torch()
    if device not in ("auto", "cpu", "cuda"):
        raise PackctlError(f"--device {device!r}: choose one of auto, cpu, cuda")
    has_cuda = torch.cuda.is_available()
    if device == "cuda" and not has_cuda:
        raise PackctlError(f"--device cuda: torch {torch.__version__} sees no CUDA device (built with CUDA "
                           f"{torch.version.cuda}); run on a GPU node with a CUDA build of torch, or pass --device cpu")
    if device == "auto":
        return "cuda" if has_cuda else "cpu"
    return device


def parse_dtypes(spec: str | None, device: str) -> list[str]:
    """'fp32,bf16' -> ['fp32', 'bf16']; default fp32 on CPU, bf16 and fp16 on CUDA."""
    if spec is None or not spec.strip():
        return ["fp32"] if device == "cpu" else ["bf16", "fp16"]
    names = []
    for part in spec.split(","):
        key = part.strip().lower()
        if key not in DTYPES:
            raise PackctlError(f"--dtype {part.strip()!r}: choose from fp32, bf16, fp16 (comma-separated)")
        name = DTYPE_NAMES[DTYPES[key]]
        if name not in names:
            names.append(name)
    return names


def torch_dtype(torch, name: str):
    return getattr(torch, DTYPES[name])


class Backend:
    """One varlen attention kernel: `__call__(q, k, v, cu_seqlens, max_seqlen, causal=True,
    softmax_scale=None) -> out`, q (T, Hq, D), k and v (T, Hkv, D) with Hq a multiple of Hkv
    (grouped-query attention). `packctl verify` and `packctl.torch.varlen_attention` both run these."""

    name = ""
    dtypes: tuple[str, ...] = ("fp32", "bf16", "fp16")
    devices: tuple[str, ...] = ("cpu", "cuda")
    exact_on_cpu = True  # outputs of other sequences are bitwise independent of a sequence's tokens

    def __init__(self, torch, device: str):
        self.torch = torch
        self.device = device
        self.mode = ""

    def unsupported(self, dtype: str) -> str | None:
        """Why this backend cannot run `dtype` on its device, or None."""
        if self.device not in self.devices:
            return f"{self.name} runs on {' and '.join(self.devices)} only"
        if dtype not in self.dtypes:
            return f"{self.name} supports {', '.join(self.dtypes)} only"
        return None

    def __call__(self, q, k, v, cu_seqlens_padded, max_seqlen: int, causal: bool = True,
                 softmax_scale: float | None = None):  # pragma: no cover - interface
        raise NotImplementedError


def _expand_kv(q, k, v):
    """k, v repeated over the query heads of their group (GQA) for kernels that need equal heads."""
    groups = q.shape[1] // k.shape[1]
    return (k, v) if groups == 1 else (k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1))


def document_ids(torch, cu_seqlens_padded, total: int):
    """Sequence index of every token: cu [0, 2, 6] -> [0, 0, 1, 1, 1, 1]."""
    lens = (cu_seqlens_padded[1:] - cu_seqlens_padded[:-1]).long()
    return torch.repeat_interleave(torch.arange(len(lens), device=cu_seqlens_padded.device), lens, output_size=total)


class SdpaBackend(Backend):
    """`scaled_dot_product_attention` over the whole pack with a block-diagonal causal boolean mask.

    Queries are processed in blocks of rows (rows are independent) so the mask never exceeds
    about 16M entries whatever the capacity.
    """

    name = "sdpa"
    mask_entries = 1 << 24

    def __init__(self, torch, device):
        super().__init__(torch, device)
        self.mode = "block-diagonal causal mask"

    def __call__(self, q, k, v, cu_seqlens_padded, max_seqlen, causal=True, softmax_scale=None):
        torch = self.torch
        total = q.shape[0]
        doc = document_ids(torch, cu_seqlens_padded, total)
        pos = torch.arange(total, device=q.device)
        k, v = _expand_kv(q, k, v)
        qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # (1, H, T, D)
        block = max(128, self.mask_entries // max(total, 1))
        parts = []
        for lo in range(0, total, block):
            hi = min(total, lo + block) if causal else total  # without causality a row sees its whole sequence
            end = min(total, lo + block)
            mask = doc[lo:end, None] == doc[None, :hi]
            if causal:
                mask &= pos[lo:end, None] >= pos[None, :hi]
            parts.append(torch.nn.functional.scaled_dot_product_attention(
                qh[:, :, lo:end], kh[:, :, :hi], vh[:, :, :hi], attn_mask=mask, scale=softmax_scale))
        return torch.cat(parts, dim=2)[0].transpose(0, 1)


class FlexBackend(Backend):
    """`flex_attention` with a document-causal `BlockMask` built from cu_seqlens_padded.

    On CUDA the kernel is compiled with `torch.compile`; on CPU flex attention runs eagerly (an
    unfused implementation that materializes the scores: slow, but the same semantics). `probe()`
    runs a tiny case first so an unsupported setup is reported, not crashed on.
    """

    name = "flex"

    def __init__(self, torch, device):
        super().__init__(torch, device)
        module = importlib.util.find_spec("torch.nn.attention.flex_attention")
        if module is None:
            raise PackctlError(f"--backend flex: torch {torch.__version__} has no torch.nn.attention.flex_attention "
                               "(needs torch >= 2.5): pip install -U 'packctl[torch]'")
        from torch.nn.attention import flex_attention as flex

        self._flex = flex
        self._fn = torch.compile(flex.flex_attention) if device == "cuda" else flex.flex_attention
        self.mode = "compiled" if device == "cuda" else "eager (unfused)"
        self._mask_key: tuple | None = None
        self._mask = None

    def probe(self, dtype: str) -> str | None:
        """None when flex attention runs here in `dtype`, else why not."""
        torch = self.torch
        try:
            x = torch.randn(8, 1, 16, device=self.device, dtype=torch_dtype(torch, dtype))
            self(x, x, x, torch.tensor([0, 3, 8], dtype=torch.int32, device=self.device), 5)
        except Exception as exc:  # noqa: BLE001 - any failure means "not available here"
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return f"flex attention does not run on {self.device} in {dtype} with torch {torch.__version__} ({first})"
        return None

    def block_mask(self, cu_seqlens_padded, total: int, causal: bool = True):
        """The document(-causal) BlockMask of a pack; the last one is kept, since the contamination
        probe runs the same pack twice."""
        key = (total, causal, tuple(cu_seqlens_padded.tolist()))
        if self._mask_key != key:
            doc = document_ids(self.torch, cu_seqlens_padded, total)

            def document_causal(b, h, q_idx, kv_idx):
                return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

            def document(b, h, q_idx, kv_idx):
                return doc[q_idx] == doc[kv_idx]

            self._mask = self._flex.create_block_mask(document_causal if causal else document, None, None, total,
                                                      total, device=cu_seqlens_padded.device)
            self._mask_key = key
        return self._mask

    def __call__(self, q, k, v, cu_seqlens_padded, max_seqlen, causal=True, softmax_scale=None):
        block_mask = self.block_mask(cu_seqlens_padded, q.shape[0], causal)
        k, v = _expand_kv(q, k, v)
        qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            out = self._fn(qh, kh, vh, block_mask=block_mask, scale=softmax_scale)
        return out[0].transpose(0, 1)


class FlashAttnBackend(Backend):
    """flash-attn's varlen kernel, whichever FlashAttention is installed.

    FlashAttention 2 (`flash_attn.flash_attn_varlen_func`, the `flash-attn` source build) when its
    package is there, else FlashAttention 4 (`flash_attn.cute.flash_attn_varlen_func`, the
    `flash-attn-4` wheel of the `gpu` extra, kernels compiled at run time by the CuTe DSL). The two
    entry points differ:

        FA2: flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal)
             -> out
        FA4: flash_attn_varlen_func(q, k, v, qv=None, cu_seqlens_q=, cu_seqlens_k=, max_seqlen_q=,
             max_seqlen_k=, ..., softmax_scale=, causal=, ...) -> (out, lse)

    FA4's fourth positional parameter is `qv`, so it is called with keywords only. Both take q
    (T, Hq, D) and k, v (T, Hkv, D) in fp16 or bf16 with the last dimension contiguous, Hq a
    multiple of Hkv (grouped-query attention without repeating k and v), cu_seqlens as contiguous
    int32 on q's device and the max lengths as Python ints.
    """

    name = "flash-attn"
    dtypes = ("bf16", "fp16")
    devices = ("cuda",)

    def __init__(self, torch, device):
        super().__init__(torch, device)
        flash_attn = require("flash_attn", "gpu", PURPOSE + " with --backend flash-attn")
        if hasattr(flash_attn, "flash_attn_varlen_func"):
            self._fn = flash_attn.flash_attn_varlen_func
            self.mode = f"FlashAttention {getattr(flash_attn, '__version__', '2')}"
            self._keywords = False
        else:
            cute = _import_flash_attn_cute()
            self._fn = cute.flash_attn_varlen_func
            version = _distribution_version("flash-attn-4")
            self.mode = f"FlashAttention 4{' ' + version if version else ''} (flash_attn.cute)"
            self._keywords = True

    def __call__(self, q, k, v, cu_seqlens_padded, max_seqlen, causal=True, softmax_scale=None):
        torch = self.torch
        half = (torch.float16, torch.bfloat16)
        if q.dtype not in half or k.dtype != q.dtype or v.dtype != q.dtype:
            raise PackctlError(f"flash-attn takes fp16 or bf16 q, k, v of one dtype, got {q.dtype}, {k.dtype}, "
                               f"{v.dtype}: cast them (verify's --dtype bf16,fp16), or use backend sdpa")
        q, k, v = (t.contiguous() for t in (q, k, v))
        cu = cu_seqlens_padded.to(device=q.device, dtype=torch.int32).contiguous()
        max_seqlen = int(max_seqlen)
        if self._keywords:
            out = self._fn(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_seqlen,
                           max_seqlen_k=max_seqlen, softmax_scale=softmax_scale, causal=causal)
        else:
            out = self._fn(q, k, v, cu, cu, max_seqlen, max_seqlen, softmax_scale=softmax_scale, causal=causal)
        return out[0] if isinstance(out, tuple) else out


def _import_flash_attn_cute():
    """flash_attn.cute, or one line naming what it lacks: FA4 imports the CuTe DSL (`cutlass`), quack
    and tvm-ffi, which come as separate wheels."""
    import importlib

    try:
        return importlib.import_module("flash_attn.cute")
    except ImportError as exc:
        missing = getattr(exc, "name", None) or str(exc)
        raise PackctlError(f"{PURPOSE} with --backend flash-attn: flash_attn has neither flash_attn_varlen_func "
                           f"(FlashAttention 2) nor a usable flash_attn.cute (FlashAttention 4; importing it "
                           f"failed on {missing!r}): pip install 'packctl[gpu]'") from exc


def _distribution_version(name: str) -> str:
    """The installed version of a distribution, '' when its metadata is absent (a source tree)."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return ""


class TorchVarlenBackend(Backend):
    """`torch.nn.attention.varlen.varlen_attn` (torch >= 2.10, CUDA).

    Its causal switch changed between releases (`is_causal=True` in 2.10, `window_size=(-1, 0)`
    later), so the signature is inspected when the backend is built.
    """

    name = "torch-varlen"
    dtypes = ("bf16", "fp16")
    devices = ("cuda",)

    def __init__(self, torch, device):
        super().__init__(torch, device)
        if importlib.util.find_spec("torch.nn.attention.varlen") is None:
            raise PackctlError(f"--backend torch-varlen: torch {torch.__version__} has no "
                               "torch.nn.attention.varlen (needs torch >= 2.10): pip install -U 'packctl[torch]'")
        from torch.nn.attention.varlen import varlen_attn

        self._fn = varlen_attn
        params = inspect.signature(varlen_attn).parameters
        self._scale = "scale" in params
        if "is_causal" in params:
            self._causal: dict[str, Any] = {"is_causal": True}
            self._full: dict[str, Any] = {"is_causal": False}
        elif "window_size" in params:
            self._causal, self._full = {"window_size": (-1, 0)}, {"window_size": (-1, -1)}
        else:
            raise PackctlError(f"--backend torch-varlen: varlen_attn{inspect.signature(varlen_attn)} in torch "
                               f"{torch.__version__} has neither is_causal nor window_size; use --backend sdpa")
        self.mode = f"varlen_attn({', '.join(f'{k}={v}' for k, v in self._causal.items())})"

    def __call__(self, q, k, v, cu_seqlens_padded, max_seqlen, causal=True, softmax_scale=None):
        cu = cu_seqlens_padded.to(device=q.device, dtype=self.torch.int32).contiguous()
        extra = dict(self._causal if causal else self._full)
        if softmax_scale is not None:
            if not self._scale:
                raise PackctlError(f"torch-varlen in torch {self.torch.__version__} takes no softmax scale; "
                                   "use backend sdpa")
            extra["scale"] = softmax_scale
        k, v = _expand_kv(q, k, v)
        out = self._fn(q, k, v, cu, cu, int(max_seqlen), int(max_seqlen), **extra)
        return out[0] if isinstance(out, tuple) else out


_CLASSES = {"sdpa": SdpaBackend, "flex": FlexBackend, "flash-attn": FlashAttnBackend,
            "torch-varlen": TorchVarlenBackend}


def available_cuda_varlen(torch) -> str:
    """The varlen kernel `auto` picks on CUDA: flash-attn when installed, else torch's, else sdpa."""
    if importlib.util.find_spec("flash_attn") is not None:
        return "flash-attn"
    if importlib.util.find_spec("torch.nn.attention.varlen") is not None:
        return "torch-varlen"
    return "sdpa"


def select_backends(name: str, device: str) -> tuple[list[Backend], list[str]]:
    """Backends for `--backend NAME` on `device`, plus notes on what `auto` left out and why.

    auto: flash-attn on CUDA when installed, else torch-varlen, else sdpa; on CPU sdpa.
    """
    torch = import_torch()
    if name != "auto" and name not in BACKENDS:
        raise PackctlError(f"--backend {name!r}: choose one of auto, {', '.join(BACKENDS)}")
    notes: list[str] = []
    if name != "auto":
        backend = _CLASSES[name](torch, device)
        if device not in backend.devices:
            raise PackctlError(f"--backend {name} runs on {' and '.join(backend.devices)} only; pass --device cuda "
                               "on a GPU node, or use --backend sdpa or flex on CPU")
        return [backend], notes
    if device == "cuda":
        picked = available_cuda_varlen(torch)
        if picked != "flash-attn":
            notes.append("flash-attn is not installed (pip install 'packctl[gpu]'); using " + picked)
        return [_CLASSES[picked](torch, device)], notes
    # On CPU flex attention runs eagerly, about 3x slower than SDPA for the same check: it runs
    # when asked for (--backend flex), not by default.
    notes.append("on CPU auto runs sdpa; pass --backend flex to check flex attention too")
    return [SdpaBackend(torch, device)], notes


_BUILT: dict[tuple[str, str], Backend] = {}


def attention_backend(name: str, device: str, dtype: str) -> Backend:
    """One backend for a training loop (`packctl.torch.varlen_attention`), built once per
    (name, device). "auto": on CUDA in fp16/bf16 the fastest varlen kernel installed, else sdpa."""
    torch = import_torch()
    if name == "auto":
        name = available_cuda_varlen(torch) if device == "cuda" and dtype in ("fp16", "bf16") else "sdpa"
    if name not in BACKENDS:
        raise ValueError(f"backend {name!r}: choose auto, {', '.join(BACKENDS)}")
    if (name, device) not in _BUILT:
        _BUILT[name, device] = _CLASSES[name](torch, device)
    return _BUILT[name, device]


def as_tensor(torch, array: np.ndarray, device: str, dtype=None):
    """numpy -> torch on `device` (no copy on CPU when the dtype already matches)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    return tensor.to(device=device, dtype=dtype) if dtype is not None else tensor.to(device)
