"""Reference oracle of TriAttention eviction and physical compaction (TRIATTENTION.md).

Plain PyTorch, CPU or CUDA tensors; every generated kernel of the pipeline is compared with these
functions: scores within a per-dtype tolerance of the float64 oracle (``dtype=torch.float64``),
selection, move packing and compaction exactly. Normalize and aggregate fix every order of
summation (``lane_sum``; layers added in order), so the generated Triton selection
(``kvgen.kernels.triton.select``) reproduces ``zscore``, ``aggregate`` and ``select_keep`` bit for
bit; the runtime can also run these very functions (``selector="oracle"``).

Stated once, for the spec, the lowering, the runtime and the tools alike: the RoPE pair rule
(``split_pairs``), normalization, aggregation and selection (``zscore``, ``aggregate``,
``select_keep``); and, re-exported from the torch-free ``triattention_family``, which families
TriAttention refuses (``refusal_reason``), the page shape (``page_shape``) and what eviction
needs of a family (``EvictionConfig``).

Tensor conventions (B = requests in the batch, Lc = cache layers, scored and SWA):
- Per-layer K (or V) pool: ``[num_pages, *page_shape]``, a page being
  ``[Hkv, tokens_per_block, head_dim]`` (HND) or ``[tokens_per_block, Hkv, head_dim]`` (NHD).
- ``page_table`` int32 ``[B, max_pages]``: token ``t`` of request ``r`` lives in page
  ``page_table[r, t // tokens_per_block]``, slot ``t % tokens_per_block``.
- ``P`` (prompt length), ``S`` (physical length of scorable tokens, protected tail excluded),
  ``C`` (evicted so far), ``tail`` (protected tail length): int64 ``[B]``. ``L = S + C``.
- Score rows ``[B, Hq, W]`` where column ``j`` is token ``P + j`` and ``W = max(S - P)``; the
  z-scores of a round are one such tensor per scored layer, in ``scored_layers`` order.
- Decision rows ``[B, R, W]``: union R = 1; per_head R = Hkv (row = kv head); per_layer_perhead
  R = Lc·Hkv (row = layer·Hkv + kv head; rows of SWA layers are zeros and never used).
- Kept positions ``[B, R, budget]`` int64, absolute (``j + P``), ascending; -1 fills slots when a
  request has fewer than ``budget`` valid tokens.
- Moves (``Moves``): ``src``/``dst`` int32 ``[Lc, Hkv, N]``, ``offsets`` int32
  ``[max_requests + 1]``; request ``r`` owns slots ``offsets[r] .. offsets[r+1]-1`` of every
  (layer, kv head), with ``offsets[r+1] - offsets[r] = budget + tail[r]`` if it is due, else 0;
  ``N = offsets[-1]``. Slot ``m`` of a request always has ``dst = P + m``. Scored layers:
  ``src = kept[m]`` for ``m < budget``, ``S + (m - budget)`` after. SWA layers (window W):
  slots ``m < budget - W`` hold ``MOVE_FILL`` (-1) in both src and dst (nothing moves there),
  later slots ``src = S - budget + m`` (the latest window, then the tail).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvgen.reference.triattention_calib import (
    Calibration,
    CalibrationError,
    load_calibration,
    longrope_attention_factor,
    rope_attention_factor,
    rope_defaults,
    rope_freq_scale_sq,
    rope_omega,
    save_calibration,
    save_upstream_calibration,
    synthetic_calibration,
    synthetic_queries,
    upstream_head_key,
    yarn_attention_factor,
)
from kvgen.reference.triattention_family import (
    MODES,
    SCORED_DTYPES,
    EvictionConfig,
    GeometryError,
    TriGeometry,
    check_budget,
    page_shape,
    refusal_reason,
)

__all__ = [
    "MODES", "MOVE_FILL", "OFFSETS", "REDUCTION_LANES", "SCORED_DTYPES", "Calibration", "CalibrationError", "EvictionConfig",
    "GeometryError", "Moves", "RoundResult", "TriGeometry", "aggregate", "apply_rope", "check_budget",
    "check_moves", "compact_paged", "compact_paged_gather", "decision_rows", "eviction_round", "gather_mean_phase",
    "gather_token_rows", "is_due", "lane_sum", "load_calibration", "longrope_attention_factor", "mean_phase_rows",
    "mean_phase_table", "num_decision_rows", "pack_moves", "page_shape", "post_round", "refusal_reason",
    "rope_attention_factor", "rope_defaults", "rope_freq_scale_sq", "rope_omega",
    "save_calibration", "save_upstream_calibration", "score_coefficients", "score_keys", "score_paged", "select_keep", "split_pairs",
    "synthetic_calibration", "synthetic_queries", "upstream_head_key", "yarn_attention_factor", "zscore",
]

OFFSETS = tuple(2 ** i for i in range(17))  # future-query offsets 1, 2, 4, ..., 65536 (§3)
MOVE_FILL = -1
STD_FLOOR = 1e-6
REDUCTION_LANES = 512  # lanes of lane_sum, the fixed summation order of the z-score statistics


def _as_long(values: object, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.int64, device=device).reshape(-1)


# ----------------------------------------------------------------------------------------------
# Pairs and RoPE (§2)
# ----------------------------------------------------------------------------------------------

def split_pairs(rows: torch.Tensor, geometry: TriGeometry) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``(re, im)`` ``[..., F]`` of the rotated span of ``[..., head_dim]`` rows: the pair rule.

    Pair ``f`` is elements ``(f, f + F)`` of the span for ``half`` pairing and ``(2f, 2f + 1)``
    for ``interleaved``. ``geometry`` needs only ``rotary_start``, ``rotary_dim``, ``pairing``
    and ``freqs`` (MLA latents, which ``TriGeometry`` refuses, rotate the same way); the element
    indices of the pairs are ``split_pairs(torch.arange(head_dim), geometry)``."""
    span = rows[..., geometry.rotary_start:geometry.rotary_start + geometry.rotary_dim]
    if geometry.pairing == "half":
        return span[..., :geometry.freqs], span[..., geometry.freqs:]
    return span[..., 0::2], span[..., 1::2]


def apply_rope(rows: torch.Tensor, positions: torch.Tensor, omega: torch.Tensor,
               geometry: TriGeometry) -> torch.Tensor:
    """RoPE at ``positions`` (shape ``rows.shape[:-1]``), computed in float64, returned in the
    rows' dtype. Elements outside the rotated span are copied unchanged (partial rotary)."""
    out = rows.to(torch.float64).clone()
    re, im = split_pairs(out, geometry)
    angle = positions.to(torch.float64)[..., None] * omega.to(torch.float64)
    new_re = re * angle.cos() - im * angle.sin()
    new_im = re * angle.sin() + im * angle.cos()
    re.copy_(new_re)
    im.copy_(new_im)
    return out.to(rows.dtype)


# ----------------------------------------------------------------------------------------------
# Mean phase (§3)
# ----------------------------------------------------------------------------------------------

def mean_phase_rows(omega: torch.Tensor, positions: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``c[..., f] = mean_o cos((L + o)·omega_f)`` and ``d`` likewise with sin, for ``L`` in
    ``positions``. Always computed in float64 (the angle reaches ~65536·omega, where float32
    loses the phase), summed over offsets in ascending order 1, 2, ..., 65536, divided by 17,
    then cast to ``dtype``. The table and the direct path share this code, so they agree bitwise.
    """
    w = omega.to(torch.float64)
    p = positions.to(torch.float64)[..., None]
    c = torch.zeros(p.shape[:-1] + w.shape, dtype=torch.float64, device=w.device)
    d = torch.zeros_like(c)
    for offset in OFFSETS:  # the fixed summation order
        angle = (p + offset) * w
        c = c + angle.cos()
        d = d + angle.sin()
    return (c / len(OFFSETS)).to(dtype), (d / len(OFFSETS)).to(dtype)


def mean_phase_table(omega: torch.Tensor, max_len: int,
                     dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``(cos_rows, sin_rows)`` ``[rows, F]`` for positions ``0 .. rows-1``, ``rows`` = the
    smallest power of two >= ``max_len`` (so the table grows by doubling)."""
    rows = 1
    while rows < max_len:
        rows *= 2
    positions = torch.arange(rows, dtype=torch.int64, device=omega.device)
    return mean_phase_rows(omega, positions, dtype)


def gather_mean_phase(table: tuple[torch.Tensor, torch.Tensor],
                      L: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One row per request: ``(c, d)`` ``[B, F]`` for int64 positions ``L`` ``[B]``."""
    cos_rows, sin_rows = table
    index = L.to(device=cos_rows.device, dtype=torch.int64)
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= cos_rows.shape[0]):
        raise IndexError(f"positions {index.tolist()} outside the mean-phase table's {cos_rows.shape[0]} rows")
    return cos_rows[index], sin_rows[index]


# ----------------------------------------------------------------------------------------------
# Scores (§3)
# ----------------------------------------------------------------------------------------------

def _require_scored(layer: int, geometry: TriGeometry) -> None:
    if layer not in geometry.scored_layers:
        raise ValueError(f"layer {layer} is sliding-window (or absent) and is never scored")


def score_coefficients(calib: Calibration, layer: int, c: torch.Tensor, d: torch.Tensor,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(a, b, m)`` ``[..., Hq, F]`` from ``c, d`` ``[..., F]``: the query mean rotated to the
    mean future phase; ``m`` weights the key magnitude."""
    device = c.device
    qr = calib.E_q[layer].real.to(device=device, dtype=dtype)
    qi = calib.E_q[layer].imag.to(device=device, dtype=dtype)
    mlr = calib.E_q_norm[layer].to(device=device, dtype=dtype) - torch.hypot(qr, qi)
    s = calib.freq_scale_sq.to(device=device, dtype=dtype)
    c = c.to(dtype)[..., None, :]
    d = d.to(dtype)[..., None, :]
    a = s * (qr * c - qi * d)
    b = s * (qr * d + qi * c)
    m = (s * mlr).expand_as(a)
    return a, b, m


def score_keys(k_rows: torch.Tensor, calib: Calibration, layer: int, c: torch.Tensor, d: torch.Tensor,
               geometry: TriGeometry, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Scores ``[..., Hq, T]`` of post-RoPE keys ``k_rows`` ``[..., Hkv, T, head_dim]`` for query
    heads of ``layer``, given mean-phase rows ``c, d`` ``[..., F]`` (same leading dims).

    K dtypes: bf16, fp16 and fp8 E4M3 (``float8_e4m3fn``) rows are widened to ``dtype`` exactly
    (every code is a float32 value). fp8 K is scored as stored: the dequantized key of an fp8
    cache with a per-tensor ``k_scale`` is ``k × k_scale`` (``score_paged``'s argument), whose
    score is exactly ``k_scale`` × this one for ``k_scale > 0`` (every term is linear in ``k``,
    ``|k|`` included), so z-scores and kept sets do not depend on it (up to the ``1e-6`` std
    floor); the score kernel therefore takes no scale."""
    _require_scored(layer, geometry)
    re, im = split_pairs(k_rows.to(dtype), geometry)
    re = re.repeat_interleave(geometry.group, dim=-3)  # KV head -> its query heads
    im = im.repeat_interleave(geometry.group, dim=-3)
    a, b, m = score_coefficients(calib, layer, c, d, dtype)
    terms = a[..., None, :] * re + b[..., None, :] * im + m[..., None, :] * torch.hypot(re, im)
    return terms.sum(dim=-1)


def _pages_and_slots(page_table: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
                     num_pages: int, tokens_per_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Physical page and slot of ``positions`` ``[B, W]``; invalid entries read page 0, slot 0."""
    safe = torch.where(valid, positions, 0)
    pages = page_table.to(torch.int64).gather(1, safe // tokens_per_block)
    pages = torch.where(valid, pages, 0)
    bad = valid & ((pages < 0) | (pages >= num_pages))
    if bool(bad.any()):
        raise IndexError(f"page table points outside the pool's {num_pages} pages")
    return pages, safe % tokens_per_block


def gather_token_rows(pool: torch.Tensor, page_table: torch.Tensor, positions: torch.Tensor,
                      valid: torch.Tensor, geometry: TriGeometry) -> torch.Tensor:
    """Rows ``[B, Hkv, W, D]`` of tokens ``positions`` ``[B, W]`` through the page table (any
    layout); rows where ``valid`` is false are unspecified."""
    pages, slots = _pages_and_slots(page_table, positions, valid, pool.shape[0], geometry.tokens_per_block)
    if geometry.layout == "HND":
        rows = pool[pages, :, slots, :]  # advanced indices split by a slice: [B, W, Hkv, D]
    else:
        rows = pool[pages, slots]        # [B, W, Hkv, D]
    return rows.permute(0, 2, 1, 3)


def score_paged(k_cache_layer: torch.Tensor, page_table: torch.Tensor, P: torch.Tensor, S: torch.Tensor,
                C: torch.Tensor, calib: Calibration, layer: int, geometry: TriGeometry,
                dtype: torch.dtype = torch.float32,
                k_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores ``[B, Hq, W]`` of decode tokens ``[P, S)`` of one layer's K pool and their
    validity ``[B, W]`` (column j = token P + j; invalid columns are 0). ``k_scale`` dequantizes
    an fp8 K pool. The mean phase is taken at ``L = S + C``."""
    device = k_cache_layer.device
    P, S, C = _as_long(P, device), _as_long(S, device), _as_long(C, device)
    width = (S - P).clamp(min=0)
    W = int(width.max()) if width.numel() else 0
    j = torch.arange(W, device=device)
    valid = j[None, :] < width[:, None]
    rows = gather_token_rows(k_cache_layer, page_table.to(device), P[:, None] + j, valid, geometry)
    k = rows.to(dtype)
    if k_scale is not None:
        k = k * k_scale
    c, d = mean_phase_rows(calib.omega.to(device), S + C, dtype)
    scores = score_keys(k, calib, layer, c, d, geometry, dtype)
    return torch.where(valid[:, None, :], scores, 0), valid


# ----------------------------------------------------------------------------------------------
# Normalize and aggregate (§4)
# ----------------------------------------------------------------------------------------------

def lane_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim ``[..., W] -> [..., 1]`` in one fixed order, so that any kernel can
    reproduce it bit for bit (torch's own ``sum`` order depends on device, shape and version).

    Column ``j`` goes to lane ``j % REDUCTION_LANES``; each lane adds its columns in ascending
    order starting from +0.0; then the lanes are folded by halving, lane ``i`` += lane
    ``i + n/2`` for ``n = REDUCTION_LANES, ..., 2``. Padding columns past ``W`` are +0.0, which
    leaves every lane unchanged (a lane never holds -0.0: it starts at +0.0)."""
    lanes = REDUCTION_LANES
    W = x.shape[-1]
    padded = torch.nn.functional.pad(x, (0, -W % lanes)) if W % lanes else x
    chunks = padded.reshape(x.shape[:-1] + (padded.shape[-1] // lanes, lanes))
    acc = torch.zeros(x.shape[:-1] + (lanes,), dtype=x.dtype, device=x.device)
    for chunk in range(chunks.shape[-2]):
        acc = acc + chunks[..., chunk, :]
    while acc.shape[-1] > 1:
        half = acc.shape[-1] // 2
        acc = acc[..., :half] + acc[..., half:]
    return acc


def zscore(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per row over its valid columns: ``(x - mean) / max(std, 1e-6)``, population std (two
    passes: mean, then mean squared deviation). Invalid columns become 0.

    The statistics are computed in float64 with ``lane_sum`` (a fixed summation order: the
    generated kernels follow it, so they match bit for bit), then rounded to the scores' dtype;
    the deviations of the second pass use the float64 mean. The normalization itself is one
    subtraction and one correctly rounded division in the scores' dtype."""
    valid = valid.expand_as(scores)
    x = torch.where(valid, scores, 0)
    wide = x.to(torch.float64)
    count = valid.sum(dim=-1, keepdim=True).clamp(min=1).to(torch.float64)
    mean = lane_sum(wide) / count
    deviation = torch.where(valid, wide - mean, 0)
    std = (lane_sum(deviation * deviation) / count).sqrt()
    mean, std = mean.to(scores.dtype), std.to(scores.dtype).clamp(min=STD_FLOOR)
    return torch.where(valid, (x - mean) / std, 0)


def num_decision_rows(mode: str, geometry: TriGeometry) -> int:
    if mode == "union":
        return 1
    if mode == "per_head":
        return geometry.kv_heads
    if mode == "per_layer_perhead":
        return geometry.num_layers * geometry.kv_heads
    raise ValueError(f"eviction_mode {mode!r}; accepted: {', '.join(MODES)}")


def decision_rows(mode: str, layer: int, geometry: TriGeometry) -> list[int]:
    """The decision row that feeds each KV head of ``layer`` (index = kv head)."""
    heads = range(geometry.kv_heads)
    if mode == "union":
        return [0 for _ in heads]
    if mode == "per_head":
        return list(heads)
    if mode == "per_layer_perhead":
        return [layer * geometry.kv_heads + head for head in heads]
    raise ValueError(f"eviction_mode {mode!r}; accepted: {', '.join(MODES)}")


def aggregate(z: Sequence[torch.Tensor], mode: str, geometry: TriGeometry) -> torch.Tensor:
    """Decision values ``[B, R, W]`` (§4) from the normalized scores of the scored layers: ``z[i]``
    ``[B, Hq, W]`` belongs to ``geometry.scored_layers[i]`` (a ``[layers, B, Hq, W]`` tensor works).

    SWA layers have no rows here: they are never scored, and their decision rows (per_layer_perhead
    only) are zeros that nothing reads. Every order of reduction is fixed, so kernels match bit for
    bit: max is exact in any order (NaN propagates), and the per_head mean adds the scored layers
    one by one in ``scored_layers`` order in the z dtype, then divides once by their count
    (a correctly rounded division by a tensor, not torch's ``mean``, whose order and reciprocal
    multiplication differ between devices)."""
    if mode not in MODES:
        raise ValueError(f"eviction_mode {mode!r}; accepted: {', '.join(MODES)}")
    if len(z) != len(geometry.scored_layers):
        raise ValueError(f"{len(z)} layers of z-scores for {len(geometry.scored_layers)} scored layers")
    B, _, W = z[0].shape
    if mode == "union":
        values = z[0].amax(dim=1)
        for rows in z[1:]:
            values = torch.maximum(values, rows.amax(dim=1))
        return values.unsqueeze(1)
    # max over the query heads of each KV group: [B, Hkv, W] per scored layer
    grouped = [rows.reshape(B, geometry.kv_heads, geometry.group, W).amax(dim=2) for rows in z]
    if mode == "per_head":
        total = grouped[0]
        for rows in grouped[1:]:
            total = total + rows
        return total / torch.full_like(total, len(grouped))
    out = z[0].new_zeros((B, geometry.num_layers, geometry.kv_heads, W))
    for layer, rows in zip(geometry.scored_layers, grouped):
        out[:, layer] = rows
    return out.reshape(B, geometry.num_layers * geometry.kv_heads, W)


# ----------------------------------------------------------------------------------------------
# Select and cadence (§5)
# ----------------------------------------------------------------------------------------------

def select_keep(values: torch.Tensor, valid_width: torch.Tensor, budget: int, P: torch.Tensor) -> torch.Tensor:
    """Kept absolute positions ``[B, ..., budget]`` int64, ascending, from ``values``
    ``[B, ..., W]``: the first ``budget`` of the stable order (value desc, index asc) among the
    ``valid_width[b]`` leading columns. Slots beyond the valid count hold -1."""
    B, W = values.shape[0], values.shape[-1]
    ones = (1,) * (values.dim() - 1)
    width = _as_long(valid_width, values.device).reshape((B,) + ones)
    base = _as_long(P, values.device).reshape((B,) + ones)
    valid = torch.arange(W, device=values.device) < width
    if bool(torch.isnan(values).logical_and(valid).any()):
        raise ValueError("NaN among the decision values")
    # -0.0 and +0.0 are one value (a tie, lower index first) whatever the sort implementation.
    # Invalid columns sort last: -inf ties with a valid -inf keep the lower (valid) index first.
    key = torch.where(valid & (values != 0), values, torch.where(valid, 0.0, float("-inf")))
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    top = order[..., :min(budget, W)]
    top = torch.where(top < width, top, W)           # invalid picks sort to the end ...
    top = torch.sort(top, dim=-1).values
    kept = torch.where(top < W, top + base, MOVE_FILL)  # ... and become -1
    missing = budget - kept.shape[-1]
    if missing > 0:
        kept = torch.cat([kept, kept.new_full(kept.shape[:-1] + (missing,), MOVE_FILL)], dim=-1)
    return kept


def is_due(P: int, S: int, C: int, L: int, budget: int, beta: int) -> bool:
    """A round is due when a multiple of ``beta`` was crossed since the last one and there is
    something to evict. Several crossings in one step still give one round."""
    crossed = (budget + C) // beta < (L - P) // beta
    return crossed and S > P + budget


def post_round(P: int, S: int, C: int, budget: int, tail: int) -> tuple[int, int]:
    """``(C, physical length)`` after a round: the ``S - P - budget`` evicted tokens are counted,
    the cache keeps the prompt, the budget and the tail."""
    return C + S - P - budget, P + budget + tail


# ----------------------------------------------------------------------------------------------
# Move packing (§6)
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Moves:
    """Packed moves; see the module docstring for the layout and the -1 fill."""

    src: torch.Tensor      # int32 [Lc, Hkv, N]
    dst: torch.Tensor      # int32 [Lc, Hkv, N]
    offsets: torch.Tensor  # int32 [max_requests + 1]

    def request_of_slot(self) -> torch.Tensor:
        """int64 ``[N]``: the request that owns each slot."""
        n = self.src.shape[-1]
        slots = torch.arange(n, device=self.offsets.device)
        return torch.searchsorted(self.offsets.to(torch.int64), slots, right=True) - 1


def _check_kept(row: torch.Tensor, p: int, s: int, budget: int, r: int) -> None:
    if s - p < budget:
        raise ValueError(f"request {r}: {s - p} decode tokens cannot fill budget {budget}")
    if bool((row < p).any() | (row >= s).any()) or bool((row[..., 1:] <= row[..., :-1]).any()):
        raise ValueError(f"request {r}: kept positions must be strictly ascending inside [P, S) = [{p}, {s})")


def pack_moves(kept: torch.Tensor, P: torch.Tensor, S: torch.Tensor, tail: torch.Tensor, active: torch.Tensor,
               budget: int, mode: str, geometry: TriGeometry, max_requests: int | None = None) -> Moves:
    """Moves of every due (``active``) request, packed at cumulative offsets.

    ``kept`` ``[B, R, budget]`` from ``select_keep``; requests ``B .. max_requests-1`` are padding
    and, like inactive ones, own no slot."""
    device = kept.device
    B = kept.shape[0]
    max_requests = B if max_requests is None else max_requests
    if max_requests < B:
        raise ValueError(f"max_requests {max_requests} < batch {B}")
    if kept.shape != (B, num_decision_rows(mode, geometry), budget):
        raise ValueError(f"kept has shape {list(kept.shape)}, expected "
                         f"{[B, num_decision_rows(mode, geometry), budget]} for mode {mode!r}")
    check_budget(budget, geometry)
    p_list, s_list = _as_long(P, device).tolist(), _as_long(S, device).tolist()
    t_list, active_list = _as_long(tail, device).tolist(), torch.as_tensor(active).reshape(-1).tolist()
    counts = [budget + t if a else 0 for t, a in zip(t_list, active_list)] + [0] * (max_requests - B)
    offsets = [0]
    for count in counts:
        offsets.append(offsets[-1] + count)
    shape = (geometry.num_layers, geometry.kv_heads, offsets[-1])
    src = torch.full(shape, MOVE_FILL, dtype=torch.int64, device=device)
    dst = torch.full(shape, MOVE_FILL, dtype=torch.int64, device=device)
    for r in range(B):
        if not active_list[r]:
            continue
        p, s, t, start = p_list[r], s_list[r], t_list[r], offsets[r]
        m = torch.arange(budget + t, device=device)
        end = start + budget + t
        for layer, window in enumerate(geometry.swa_window):
            if window is None:
                rows = torch.tensor(decision_rows(mode, layer, geometry), device=device)
                _check_kept(kept[r, rows], p, s, budget, r)  # rows of SWA layers are never read
                src[layer, :, start:start + budget] = kept[r, rows]
                src[layer, :, start + budget:end] = s + torch.arange(t, device=device)
                dst[layer, :, start:end] = p + m
            else:
                first = budget - window  # slots before the window's destination base move nothing
                src[layer, :, start + first:end] = s - budget + m[first:]
                dst[layer, :, start + first:end] = p + m[first:]
    return Moves(src.to(torch.int32), dst.to(torch.int32),
                 torch.tensor(offsets, dtype=torch.int32, device=device))


def check_moves(moves: Moves) -> None:
    """The invariant compaction relies on: for every (layer, head, request) the real moves have
    strictly increasing sources and ``0 <= dst <= src``; fill slots are -1 in both."""
    offsets = moves.offsets.tolist()
    src, dst = moves.src.to(torch.int64), moves.dst.to(torch.int64)
    if bool(((src < 0) != (dst < 0)).any()) or bool(((src < 0) & ((src != MOVE_FILL) | (dst != MOVE_FILL))).any()):
        raise ValueError(f"fill slots must hold {MOVE_FILL} in both src and dst")
    if bool((dst > src).any()):
        raise ValueError("a destination passes its source")
    for r in range(len(offsets) - 1):
        seg = src[..., offsets[r]:offsets[r + 1]]
        if seg.shape[-1] < 2:
            continue
        before = torch.cummax(seg, dim=-1).values[..., :-1]  # fill (-1) never raises the max
        later = seg[..., 1:]
        if bool(((later >= 0) & (later <= before)).any()):
            raise ValueError(f"request {r}: sources are not strictly increasing")


# ----------------------------------------------------------------------------------------------
# Compaction (§7)
# ----------------------------------------------------------------------------------------------

def _token_index(geometry: TriGeometry, pages: torch.Tensor, heads: torch.Tensor,
                 slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Index tuple selecting rows (page, head, slot) of a pool in the geometry's layout."""
    if geometry.layout == "HND":
        return pages, heads, slots
    return pages, slots, heads


def _move_rows(pool: torch.Tensor, page_table: torch.Tensor, request: torch.Tensor, src: torch.Tensor,
               dst: torch.Tensor, geometry: TriGeometry) -> None:
    """All moves of one layer and pool: read every source row, then write every destination.

    Equal to copying in ascending move order because, per (head, request), sources increase and
    ``dst(m) <= src(m) < src(m')`` for m < m': no move reads a row an earlier one wrote; and
    different (head, request) never share bytes."""
    heads = torch.arange(src.shape[0], device=src.device)[:, None].expand_as(src)
    requests = request[None, :].expand_as(src)
    real = (src >= 0) & (src != dst)  # identical source and destination are skipped
    h, r, s, d = heads[real], requests[real], src[real].long(), dst[real].long()
    table = page_table.to(device=pool.device, dtype=torch.int64)
    tpb = geometry.tokens_per_block
    src_pages, dst_pages = table[r, s // tpb], table[r, d // tpb]
    for pages in (src_pages, dst_pages):
        if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= pool.shape[0]):
            raise IndexError(f"page table points outside the pool's {pool.shape[0]} pages")
    raw = pool.view(torch.uint8)  # bytes: exact for any dtype, fp8 included
    rows = raw[_token_index(geometry, src_pages, h, s % tpb)]
    raw[_token_index(geometry, dst_pages, h, d % tpb)] = rows


def compact_paged(k_pools: Sequence[torch.Tensor], v_pools: Sequence[torch.Tensor], page_table: torch.Tensor,
                  moves: Moves, geometry: TriGeometry) -> None:
    """In place: copy the K and V rows of token ``src`` to token ``dst`` for every move (§7).
    Changes no length and frees no page."""
    check_moves(moves)
    request = moves.request_of_slot()
    for layer in range(geometry.num_layers):
        for pool in (k_pools[layer], v_pools[layer]):
            _move_rows(pool, page_table, request.to(pool.device), moves.src[layer].to(pool.device),
                       moves.dst[layer].to(pool.device), geometry)


def compact_paged_gather(k_pools: Sequence[torch.Tensor], v_pools: Sequence[torch.Tensor],
                         page_table: torch.Tensor, moves: Moves,
                         geometry: TriGeometry) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Test-only restatement of compaction as a gather, out of place: per (layer, head, request)
    the new logical sequence is ``old[index]`` with ``index[dst] = src`` and identity elsewhere,
    all read from the untouched original."""
    offsets = moves.offsets.tolist()
    outputs = []
    for pools in (k_pools, v_pools):
        new_pools = [pool.clone() for pool in pools]
        for layer in range(geometry.num_layers):
            for r in range(len(offsets) - 1):
                if offsets[r + 1] == offsets[r]:
                    continue
                _gather_request(pools[layer], new_pools[layer], page_table[r], moves, layer,
                                offsets[r], offsets[r + 1], geometry)
        outputs.append(new_pools)
    return outputs[0], outputs[1]


def _gather_request(old: torch.Tensor, new: torch.Tensor, table_row: torch.Tensor, moves: Moves, layer: int,
                    begin: int, end: int, geometry: TriGeometry) -> None:
    tpb = geometry.tokens_per_block
    for head in range(geometry.kv_heads):
        src = moves.src[layer, head, begin:end].long()
        dst = moves.dst[layer, head, begin:end].long()
        real = src >= 0
        length = int(src[real].max()) + 1 if bool(real.any()) else 0
        index = torch.arange(length, device=src.device)
        index[dst[real]] = src[real]
        positions = torch.arange(length, device=src.device)
        pages = table_row.long()[positions // tpb]
        heads = torch.full_like(positions, head)
        sequence = old[_token_index(geometry, pages, heads, positions % tpb)]
        new[_token_index(geometry, pages, heads, positions % tpb)] = sequence[index]


# ----------------------------------------------------------------------------------------------
# One round
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RoundResult:
    due: torch.Tensor      # bool [B]
    values: torch.Tensor   # decision values [B, R, W]
    kept: torch.Tensor     # int64 [B, R, budget]; -1 for requests not due
    moves: Moves
    lengths: torch.Tensor  # int64 [B] physical length after the round (tail included)
    evicted: torch.Tensor  # int64 [B] tokens evicted by this round
    C: torch.Tensor        # int64 [B] evicted so far, after the round


def eviction_round(k_pools: Sequence[torch.Tensor], v_pools: Sequence[torch.Tensor], page_table: torch.Tensor,
                   P: torch.Tensor, S: torch.Tensor, C: torch.Tensor, tail: torch.Tensor, calib: Calibration,
                   geometry: TriGeometry, budget: int, beta: int, mode: str = "union",
                   max_requests: int | None = None, dtype: torch.dtype = torch.float32,
                   k_scale: float | None = None) -> RoundResult:
    """Score -> normalize -> aggregate -> select -> pack -> compact, for one batch, in place."""
    device = k_pools[geometry.scored_layers[0]].device
    P, S, C, tail = (_as_long(x, device) for x in (P, S, C, tail))
    due_list = [is_due(p, s, c, s + c, budget, beta)
                for p, s, c in zip(P.tolist(), S.tolist(), C.tolist())]
    due = torch.tensor(due_list, dtype=torch.bool, device=device)
    z = []
    for layer in geometry.scored_layers:
        scores, valid = score_paged(k_pools[layer], page_table, P, S, C, calib, layer, geometry, dtype, k_scale)
        z.append(zscore(scores, valid[:, None, :]))
    values = aggregate(z, mode, geometry)
    kept = select_keep(values, S - P, budget, P)
    kept = torch.where(due[:, None, None], kept, MOVE_FILL)
    moves = pack_moves(kept, P, S, tail, due, budget, mode, geometry, max_requests)
    compact_paged(k_pools, v_pools, page_table, moves, geometry)
    evicted = torch.where(due, S - P - budget, 0)
    lengths = torch.where(due, P + budget + tail, S + tail)
    return RoundResult(due, values, kept, moves, lengths, evicted, C + evicted)
