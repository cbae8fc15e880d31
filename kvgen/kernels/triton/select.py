"""Normalize, aggregate and select (TRIATTENTION.md §4-§5) in Triton, for any family.

Three kernels after the scorer, matching ``kvgen.reference.triattention`` bit for bit:

1. ``_stats_kernel``: per score row (scored layer, request, query head) the mean and the
   population std over its valid columns, in float64 and in ``lane_sum``'s fixed order (column
   ``j`` into lane ``j % REDUCTION_LANES``, lanes added in ascending column order, then folded by
   halving), rounded to float32, the std floored at ``STD_FLOOR``: exactly ``zscore``'s statistics.
   The squared deviations need the mean first: a row is read twice, or once where it fits the
   registers a program holds (``RESIDENT_STEPS``; the same additions in the same order).
2. ``_aggregate_kernel``: the decision values ``[B, R, W]`` of ``aggregate`` for the eviction mode
   (a compile-time constant), z-normalizing on the fly (one subtraction, one correctly rounded
   division) so the z-scores are never written. Max propagates NaN as torch's does; the per_head
   mean adds the scored layers in order and divides once, as the reference states it.
3. ``_select_kernel``: one program per decision row, ``select_keep``: the stable top-``budget``
   (value descending, index ascending) among the row's valid columns, emitted ascending as
   absolute positions, -1 past the valid count. Values become order-preserving integer keys
   (-0.0 and +0.0 one key); a radix search, ``RADIX_BITS`` bits per pass over the row, finds the
   ``budget``-th largest key ``t`` (``ROUTE`` 0 by comparing every key with each candidate digit,
   1 by a histogram of the digits: the same counts); a last pass keeps every key ``> t`` and the lowest-index keys
   ``== t`` up to the budget, compacted by a running cumulative sum. That pass also counts NaN
   among the valid values: the oracle raises on any, ``Selection.check`` raises the same error.

Every kernel is compiled with ``enable_fp_fusion=False``: a fused multiply-add would round once
where the reference rounds twice. A width past W counts as W, so no load leaves its row whatever
the device holds; the host side (``kvgen.kernels.selection.SelectionHost``) checks shapes, dtypes
and the budget before launching.

Two ways to run them, same kernels, same constants (``SelectionHost.*_constants``):
- ``TritonSelector``: Triton JIT-compiles on the first call (a checkout's generated
  ``generated/<family>/select.py`` binds one to the family's constants; the CPU tests run it in
  Triton's interpreter);
- ahead of time: ``aot_specializations`` lists each kernel with its signature and constants, and
  ``kvgen.build.triton_aot`` compiles them for the target into ``lib<symbol>_select.so``
  (``kvgen/kernels/include/kvgen_select.h``), which runs without Triton.
(Plain pointer arithmetic: Triton 3.6 and newer.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvgen.kernels.selection import MODES, MOVE_FILL, Selection, SelectionHost  # noqa: F401 - part of this API
from kvgen.kernels.triton.aot import Specialization

# ----------------------------------------------------------------------------------------------
# 1. Row statistics
# ----------------------------------------------------------------------------------------------

@triton.jit
def _lane_fold(acc, ROWS: tl.constexpr, LANES: tl.constexpr, LOG2_LANES: tl.constexpr):
    """``[ROWS, LANES]`` -> ``[ROWS]``: lane i += lane i + n/2 for n = LANES .. 2 (each step sums
    an axis of two, i.e. exactly one addition per pair, in no order that could matter)."""
    for level in tl.static_range(LOG2_LANES):
        acc = tl.sum(tl.reshape(acc, (ROWS, 2, LANES >> (level + 1))), axis=1)
    return tl.reshape(acc, (ROWS,))


@triton.jit
def _lane_sums(scores_ptr, base, width, lane, end, mean, SQUARES: tl.constexpr, ROWS: tl.constexpr,
               LANES: tl.constexpr, UNROLL: tl.constexpr):
    """``[ROWS, LANES]`` float64: column j of each row into lane j % LANES in ascending column order
    (the values, or with ``SQUARES`` their squared deviations from ``mean``). UNROLL steps of
    LANES columns are loaded at once; each lane still adds its columns one by one, in order."""
    acc = tl.zeros((ROWS, LANES), dtype=tl.float64)
    for start in range(0, end, LANES * UNROLL):
        for step in tl.static_range(UNROLL):
            column = start + step * LANES + lane
            valid = column < width[:, None]
            x = tl.load(scores_ptr + base + column, mask=valid, other=0.0).to(tl.float64)
            if SQUARES:
                deviation = tl.where(valid, x - mean[:, None], 0.0)
                acc += deviation * deviation
            else:
                acc += x
    return acc


@triton.jit
def _two_read_moments(scores_ptr, base, width, lane, count, ROWS: tl.constexpr, LANES: tl.constexpr,
                      LOG2_LANES: tl.constexpr, UNROLL: tl.constexpr):
    """(mean, folded sum of squared deviations) of each row, reading it twice: the values, then
    their deviations from the mean."""
    # Each row stops at its own width: the columns it skips would add +0.0, which changes no lane.
    end = tl.max(width, axis=0)
    no_mean = tl.zeros((ROWS,), dtype=tl.float64)
    sums = _lane_sums(scores_ptr, base, width, lane, end, no_mean, False, ROWS, LANES, UNROLL)
    mean = _lane_fold(sums, ROWS, LANES, LOG2_LANES) / count
    squares = _lane_sums(scores_ptr, base, width, lane, end, mean, True, ROWS, LANES, UNROLL)
    return mean, _lane_fold(squares, ROWS, LANES, LOG2_LANES)


# Triton's interpreter runs no inline PTX; there _widen is the plain conversion (the same value).
_PTX_WIDEN = tl.constexpr(not triton.knobs.runtime.interpret)


@triton.jit
def _widen(x):
    """float32 -> float64, exactly ``x.to(tl.float64)`` (cvt.f64.f32 is exact), but as inline PTX the
    compiler cannot merge it with the second sum's conversion of the same value and keep every held
    column live at both widths (75 against 106 registers at 16384 columns on 16 warps, sm_90)."""
    if _PTX_WIDEN:
        return tl.inline_asm_elementwise("cvt.f64.f32 $0, $1;", "=d,r", [x], dtype=tl.float64, is_pure=True,
                                         pack=1)
    else:
        return x.to(tl.float64)


@triton.jit
def _resident_moments(scores_ptr, base, width, lane, count, ROWS: tl.constexpr, LANES: tl.constexpr,
                      LOG2_LANES: tl.constexpr, STEPS: tl.constexpr):
    """The same two sums from one read: a row's first STEPS x LANES columns (the whole row: the
    caller checks W) stay in registers between them. Each lane adds its columns in ascending order,
    as ``_lane_sums`` does; the columns past the width add +0.0 there too."""
    held = ()
    sums = tl.zeros((ROWS, LANES), dtype=tl.float64)
    # one 64-bit address per lane, each step a constant offset from it (not one address a step)
    lane_ptr = scores_ptr + base + lane
    for step in tl.static_range(STEPS):
        column = step * LANES + lane
        x = tl.load(lane_ptr + step * LANES, mask=column < width[:, None], other=0.0)
        held = held + (x,)
        sums += _widen(x)
    mean = _lane_fold(sums, ROWS, LANES, LOG2_LANES) / count
    squares = tl.zeros((ROWS, LANES), dtype=tl.float64)
    for step in tl.static_range(STEPS):
        column = step * LANES + lane
        deviation = tl.where(column < width[:, None], held[step].to(tl.float64) - mean[:, None], 0.0)
        squares += deviation * deviation
    return mean, _lane_fold(squares, ROWS, LANES, LOG2_LANES)


@triton.jit
def _row_statistics(scores_ptr, width_ptr, mean_ptr, std_ptr, row, live, request, W, ROWS: tl.constexpr,
                    LANES: tl.constexpr, LOG2_LANES: tl.constexpr, UNROLL: tl.constexpr,
                    RESIDENT_STEPS: tl.constexpr, STD_FLOOR: tl.constexpr):
    """Writes ``mean[row]`` and ``std[row]`` of the ``ROWS`` rows ``row`` (``live``: those that
    exist) of ``request``. Rows of at most RESIDENT_STEPS x LANES columns are read once
    (``_resident_moments``); wider rows, or every row at RESIDENT_STEPS 0, twice
    (``_two_read_moments``: the second read partly hits L2 when few rows are in flight)."""
    # A width past W counts as W: whatever the device holds, no load leaves the row.
    width = tl.minimum(tl.load(width_ptr + request, mask=live, other=0), W)
    base = row.to(tl.int64)[:, None] * W
    lane = tl.arange(0, LANES)[None, :]
    count = tl.maximum(width, 1).to(tl.float64)
    # float64 '/' and sqrt are correctly rounded (div.rn.f64, sqrt.rn.f64; div_rn/sqrt_rn are float32-only)
    if RESIDENT_STEPS == 0:
        mean, squares = _two_read_moments(scores_ptr, base, width, lane, count, ROWS, LANES, LOG2_LANES, UNROLL)
    elif W <= RESIDENT_STEPS * LANES:
        mean, squares = _resident_moments(scores_ptr, base, width, lane, count, ROWS, LANES, LOG2_LANES,
                                          RESIDENT_STEPS)
    else:
        mean, squares = _two_read_moments(scores_ptr, base, width, lane, count, ROWS, LANES, LOG2_LANES, UNROLL)
    std = tl.sqrt(squares / count).to(tl.float32)
    std = tl.where(std < STD_FLOOR, STD_FLOOR, std)  # torch's clamp: NaN stays NaN
    tl.store(mean_ptr + row, mean.to(tl.float32), mask=live)
    tl.store(std_ptr + row, std, mask=live)


@triton.jit
def _stats_kernel(scores_ptr, width_ptr, mean_ptr, std_ptr, num_rows, batch, W,
                  QUERY_HEADS: tl.constexpr, ROWS: tl.constexpr, LANES: tl.constexpr,
                  LOG2_LANES: tl.constexpr, UNROLL: tl.constexpr, RESIDENT_STEPS: tl.constexpr,
                  STD_FLOOR: tl.constexpr):
    """Program p: rows p*ROWS .. p*ROWS+ROWS-1 of the scores ``[layers * B * Hq, W]`` (one row of
    16 warps by default: few rows in flight, so a row's second read partly hits L2)."""
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = row < num_rows
    _row_statistics(scores_ptr, width_ptr, mean_ptr, std_ptr, row, live, (row // QUERY_HEADS) % batch, W, ROWS,
                    LANES, LOG2_LANES, UNROLL, RESIDENT_STEPS, STD_FLOOR)


# ----------------------------------------------------------------------------------------------
# 2. Aggregation
# ----------------------------------------------------------------------------------------------

@triton.jit
def _max_nan(a, b):
    """torch's max: NaN wins (tl.maximum would return the other operand)."""
    return tl.where((a > b) | (a != a), a, b)


@triton.jit
def _group_max(scores_ptr, mean_ptr, std_ptr, first_row, column, valid, W, HEADS: tl.constexpr,
               HEAD_STEP: tl.constexpr, STEPS: tl.constexpr):
    """``[BLOCK_W]``: the max over the HEADS rows ``first_row ..`` of their z-scores ``(x - mean) / std``
    at ``column``, 0 at invalid columns; HEAD_STEP rows a step (STEPS steps), so a program holds
    HEAD_STEP x BLOCK_W values, not all the heads' (max is exact in any order, NaN winning). mean
    and std are read past L1: in the queue kernel other programs of the same launch wrote them."""
    acc = tl.full(column.shape, float("-inf"), dtype=tl.float32)
    for step in range(STEPS):
        h = step * HEAD_STEP + tl.arange(0, HEAD_STEP)
        live_head = h < HEADS
        row = first_row + h
        mean = tl.load(mean_ptr + row, mask=live_head, other=0.0, cache_modifier=".cg")
        std = tl.load(std_ptr + row, mask=live_head, other=1.0, cache_modifier=".cg")
        x = tl.load(scores_ptr + row.to(tl.int64)[:, None] * W + column[None, :],
                    mask=live_head[:, None] & valid[None, :], other=0.0)
        z = tl.where(valid[None, :], tl.div_rn(x - mean[:, None], std[:, None]), 0.0)
        z = tl.where(live_head[:, None], z, float("-inf"))
        acc = _max_nan(acc, tl.reduce(z, 0, _max_nan))
    return acc


@triton.jit
def _aggregate_kernel(scores_ptr, mean_ptr, std_ptr, width_ptr, layers_ptr, out_ptr, batch, W, num_scored,
                      out_rows, MODE: tl.constexpr, QUERY_HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                      HEADS: tl.constexpr, HEAD_STEP: tl.constexpr, STEPS: tl.constexpr, BLOCK_W: tl.constexpr):
    """Program (column tile, request, KV head) writes its decision values of that tile.

    MODE 0 union (one program per tile and request: its max over every query head and scored
    layer), 1 per_head (its KV group's max, added over the scored layers in order, / their
    count), 2 per_layer_perhead (its KV group's max of each scored layer, at row layer*Hkv + head;
    rows of sliding layers are left as allocated: zeros)."""
    column = tl.program_id(0) * BLOCK_W + tl.arange(0, BLOCK_W)
    request = tl.program_id(1)
    kv_head = tl.program_id(2)
    width = tl.minimum(tl.load(width_ptr + request), W)
    valid = column < width
    in_row = column < W
    head = kv_head * HEADS       # union: HEADS = Hq and kv_head = 0; else the group's first head
    acc = tl.zeros((BLOCK_W,), dtype=tl.float32)
    if MODE == 0:
        acc = tl.full((BLOCK_W,), float("-inf"), dtype=tl.float32)
    out_request = out_ptr + request.to(tl.int64) * out_rows * W
    for i in range(num_scored):
        group_max = _group_max(scores_ptr, mean_ptr, std_ptr, (i * batch + request) * QUERY_HEADS + head, column,
                               valid, W, HEADS, HEAD_STEP, STEPS)
        if MODE == 0:
            acc = _max_nan(acc, group_max)
        elif MODE == 1:
            acc = tl.where(i == 0, group_max, acc + group_max)  # the first layer is taken as is
        else:
            layer = tl.load(layers_ptr + i)
            tl.store(out_request + (layer * KV_HEADS + kv_head) * W + column, group_max, mask=in_row)
    if MODE == 0:
        tl.store(out_request + column, acc, mask=in_row)
    elif MODE == 1:
        count = tl.zeros((BLOCK_W,), dtype=tl.float32) + num_scored
        tl.store(out_request + kv_head * W + column, tl.div_rn(acc, count), mask=in_row)


# ----------------------------------------------------------------------------------------------
# 2b. Statistics and aggregation in one launch, each chunk of rows read from L2 the second time
# ----------------------------------------------------------------------------------------------

@triton.jit
def _wait_at_least(counter_ptr, target):
    """Spins until ``*counter_ptr >= target`` (acquire: what the releasing programs wrote before
    counting is visible after it)."""
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire")
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire")


@triton.jit
def _count_done(counter_ptr):
    """``*counter_ptr += 1`` once every thread of the program has issued its stores (release)."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release")


@triton.jit
def _queue_item(ticket, chunks, agg_items, STATS_ITEMS: tl.constexpr, LAG: tl.constexpr):
    """Ticket -> (is_stats, chunk, item), in the order S0 .. S(LAG-1), then chunk j's segment for
    each j: the statistics S(j + LAG) while there are some, and the aggregation A(j)."""
    ahead = tl.minimum(chunks, LAG)                   # chunks whose statistics open the queue
    opening = ticket < ahead * STATS_ITEMS
    segments = chunks - ahead                         # segments with statistics in them
    segment_items = STATS_ITEMS + agg_items
    after = tl.maximum(ticket - ahead * STATS_ITEMS, 0)
    with_stats = after < segments * segment_items
    past = after - segments * segment_items           # into the segments of aggregation alone
    j = tl.where(with_stats, after // segment_items, segments + past // agg_items)
    offset = tl.where(with_stats, after - j * segment_items, past - (j - segments) * agg_items)
    stats_here = tl.where(with_stats, STATS_ITEMS, 0)
    is_stats = opening | (offset < stats_here)
    chunk = tl.where(opening, ticket // STATS_ITEMS, tl.where(is_stats, j + ahead, j))
    item = tl.where(opening, ticket % STATS_ITEMS, tl.where(is_stats, offset, offset - stats_here))
    return is_stats, chunk, item


@triton.jit
def _queue_kernel(scores_ptr, width_ptr, mean_ptr, std_ptr, layers_ptr, out_ptr, work_ptr, batch, W, num_scored,
                  out_rows, MODE: tl.constexpr, QUERY_HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                  HEADS: tl.constexpr, HEAD_STEP: tl.constexpr, STEPS: tl.constexpr, BLOCK_W: tl.constexpr,
                  ROWS: tl.constexpr, LANES: tl.constexpr, LOG2_LANES: tl.constexpr, UNROLL: tl.constexpr,
                  RESIDENT_STEPS: tl.constexpr, STD_FLOOR: tl.constexpr, CHUNK: tl.constexpr,
                  LAG: tl.constexpr):
    """``_stats_kernel`` then ``_aggregate_kernel`` (same results, bit for bit) as one queue of work
    items, so that the aggregation reads each row from L2 soon after the statistics read it from
    DRAM, instead of a second pass over every score.

    A chunk is one scored layer of CHUNK requests (its rows are contiguous); chunks go layer by
    layer. Its items: the statistics of ROWS rows, and the aggregation of one column tile of one
    request (and KV group). Programs take tickets from ``work[0]`` in ``_queue_item``'s order: a
    chunk's aggregation is queued LAG chunks of statistics after its own (enough programs in
    between that its statistics are done, few enough rows that they are still in L2), and waits
    until ``work[1 + chunk]`` counts all of them. Union and per_head fold a tile's
    layers in order as the aggregation kernel does, in ``out`` itself: a layer's item waits until
    its tile's counter ``work[1 + chunks + (request * groups + group) * tiles + tile]`` has counted
    the layers before it. Every wait is on items of earlier tickets, which programs already running
    hold: no wait can deadlock, whatever the grid (the interpreter's one program never waits).
    ``work`` must be zero at launch (``queue_work_ints``)."""
    GROUPS: tl.constexpr = 1 if MODE == 0 else KV_HEADS
    STATS_ITEMS: tl.constexpr = (CHUNK * QUERY_HEADS + ROWS - 1) // ROWS
    tiles = tl.cdiv(W, BLOCK_W)
    agg_items = CHUNK * GROUPS * tiles
    request_groups = tl.cdiv(batch, CHUNK)
    chunks = num_scored * request_groups
    done_ptr = work_ptr + 1
    order_ptr = done_ptr + chunks
    ticket = tl.atomic_add(work_ptr, 1)
    while ticket < chunks * (STATS_ITEMS + agg_items):
        is_stats, chunk, item = _queue_item(ticket, chunks, agg_items, STATS_ITEMS, LAG)
        layer = chunk // request_groups
        first = (chunk - layer * request_groups) * CHUNK
        if is_stats:
            local = item * ROWS + tl.arange(0, ROWS)
            row_request = first + local // QUERY_HEADS
            live = (local < CHUNK * QUERY_HEADS) & (row_request < batch)
            _row_statistics(scores_ptr, width_ptr, mean_ptr, std_ptr, (layer * batch + first) * QUERY_HEADS + local,
                            live, row_request, W, ROWS, LANES, LOG2_LANES, UNROLL, RESIDENT_STEPS, STD_FLOOR)
            _count_done(done_ptr + chunk)
        else:
            tile = item % tiles
            group = (item // tiles) % GROUPS
            request = first + item // (tiles * GROUPS)
            if request < batch:
                column = tile * BLOCK_W + tl.arange(0, BLOCK_W)
                width = tl.minimum(tl.load(width_ptr + request), W)
                valid = column < width
                in_row = column < W
                _wait_at_least(done_ptr + chunk, STATS_ITEMS)
                group_max = _group_max(scores_ptr, mean_ptr, std_ptr, (layer * batch + request) * QUERY_HEADS
                                       + group * HEADS, column, valid, W, HEADS, HEAD_STEP, STEPS)
                out_request = out_ptr + request.to(tl.int64) * out_rows * W
                if MODE == 2:
                    tl.store(out_request + (tl.load(layers_ptr + layer) * KV_HEADS + group) * W + column, group_max,
                             mask=in_row)
                else:
                    order = order_ptr + (request * GROUPS + group) * tiles + tile
                    _wait_at_least(order, layer)
                    out_tile = out_request + group * W + column
                    folded = group_max
                    if layer > 0:   # the layers before, as the aggregation kernel folds them
                        before = tl.load(out_tile, mask=in_row, other=0.0, cache_modifier=".cg")
                        if MODE == 0:
                            folded = _max_nan(before, group_max)
                        else:
                            folded = before + group_max
                    if MODE == 1:
                        if layer == num_scored - 1:
                            folded = tl.div_rn(folded, tl.zeros((BLOCK_W,), dtype=tl.float32) + num_scored)
                    tl.store(out_tile, folded, mask=in_row)
                    _count_done(order)
        ticket = tl.atomic_add(work_ptr, 1)


# ----------------------------------------------------------------------------------------------
# 3. Selection
# ----------------------------------------------------------------------------------------------

@triton.jit
def _keys(row_ptr, column, width):
    """Order-preserving int64 keys in [1, 2^32) of the valid values (-0.0 as +0.0), -1 elsewhere;
    and the values (for the NaN count)."""
    valid = column < width
    value = tl.load(row_ptr + column, mask=valid, other=0.0)
    value = tl.where(value == 0.0, 0.0, value)
    bits = value.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negative floats: reverse the magnitude
    key = ordered.to(tl.int64) + 2147483648
    return tl.where(valid, key, -1), value, valid


@triton.jit
def _threshold_by_comparison(row_ptr, width, budget, lane, BLOCK: tl.constexpr, RADIX_BITS: tl.constexpr):
    """(t, count(key > t)): the budget-th largest key t, the largest t with count(key >= t) >= budget,
    built digit by digit from the top. Each pass compares every key with the candidates t + k*2^shift
    for k = 1 .. DIGITS (k = DIGITS is the next digit up, which an earlier pass already refused: it
    never passes). t is 0 when fewer keys are valid."""
    DIGITS: tl.constexpr = 1 << RADIX_BITS
    digit = tl.arange(0, DIGITS)
    t = tl.zeros((), dtype=tl.int64)
    above = tl.zeros((), dtype=tl.int64)   # count(key > t) once the last digit is known
    for level in tl.static_range(32 // RADIX_BITS):
        shift = 32 - RADIX_BITS * (level + 1)
        candidate = t + ((digit + 1).to(tl.int64) << shift)
        counts = tl.zeros((DIGITS,), dtype=tl.int32)
        for start in range(0, width, BLOCK):
            key, _, _ = _keys(row_ptr, start + lane, width)
            counts += tl.sum((key[:, None] >= candidate[None, :]).to(tl.int32), axis=0)
        chosen = tl.sum((counts >= budget).to(tl.int64), axis=0)   # counts fall with k
        t += chosen << shift
        above = tl.sum(tl.where(digit == chosen, counts, 0), axis=0).to(tl.int64)
    return t, above


@triton.jit
def _threshold_by_histogram(row_ptr, width, budget, lane, BLOCK: tl.constexpr, RADIX_BITS: tl.constexpr):
    """The same (t, count(key > t)) from a histogram per pass: the next digit of the keys that share
    t's known prefix (``tl.histogram``), one count per key instead of one comparison per candidate.
    count(key >= t + k*2^shift) is then the keys above the prefix plus that histogram's tail from k."""
    DIGITS: tl.constexpr = 1 << RADIX_BITS
    digit = tl.arange(0, DIGITS)
    t = tl.zeros((), dtype=tl.int64)
    above = tl.zeros((), dtype=tl.int64)   # count(key >= t + 2^(shift + RADIX_BITS)): above the prefix
    for level in tl.static_range(32 // RADIX_BITS):
        shift = 32 - RADIX_BITS * (level + 1)
        prefix = t >> (shift + RADIX_BITS)
        counts = tl.zeros((DIGITS,), dtype=tl.int32)
        for start in range(0, width, BLOCK):
            key, _, valid = _keys(row_ptr, start + lane, width)
            inside = valid & ((key >> (shift + RADIX_BITS)) == prefix)
            counts += tl.histogram(((key >> shift) & (DIGITS - 1)).to(tl.int32), DIGITS, mask=inside)
        at_least = above + (tl.sum(counts, axis=0) - tl.cumsum(counts, axis=0) + counts).to(tl.int64)
        # k = 0 is t itself, which every earlier pass already accepted
        chosen = tl.sum(((digit >= 1) & (at_least >= budget)).to(tl.int64), axis=0)
        t += chosen << shift
        # count(key >= t + 2^shift): the next digit's count, or the old prefix's when chosen is the last
        above = tl.max(tl.where(digit == chosen + 1, at_least, above), axis=0)
    return t, above


@triton.jit
def _select_kernel(values_ptr, width_ptr, P_ptr, kept_ptr, nan_ptr, rows_per_request, W, budget,
                   BLOCK: tl.constexpr, RADIX_BITS: tl.constexpr, ROUTE: tl.constexpr):
    """Program r: decision row r (= request * rows_per_request + row) -> kept_ptr[r, :budget].
    ROUTE 0 finds the threshold by comparisons, 1 by histograms (the same t and count)."""
    row = tl.program_id(0)
    request = row // rows_per_request
    width = tl.minimum(tl.load(width_ptr + request), W)
    base = tl.load(P_ptr + request)
    row_ptr = values_ptr + row.to(tl.int64) * W
    kept_row = kept_ptr + row.to(tl.int64) * budget
    lane = tl.arange(0, BLOCK)
    if ROUTE == 0:
        t, above = _threshold_by_comparison(row_ptr, width, budget, lane, BLOCK, RADIX_BITS)
    else:
        t, above = _threshold_by_histogram(row_ptr, width, budget, lane, BLOCK, RADIX_BITS)

    # Ascending pass: every key > t, and the first (budget - above) keys == t.
    ties_wanted = budget - above
    taken = tl.zeros((), dtype=tl.int64)
    ties = tl.zeros((), dtype=tl.int64)
    nans = tl.zeros((), dtype=tl.int32)
    for start in range(0, width, BLOCK):
        column = start + lane
        key, value, valid = _keys(row_ptr, column, width)
        tie = (key == t).to(tl.int64)
        tie_rank = ties + tl.cumsum(tie, axis=0) - tie
        keep = ((key > t) | ((tie != 0) & (tie_rank < ties_wanted))).to(tl.int64)
        slot = taken + tl.cumsum(keep, axis=0) - keep
        tl.store(kept_row + slot, base + column, mask=(keep != 0) & (slot < budget))
        taken += tl.sum(keep, axis=0)
        ties += tl.sum(tie, axis=0)
        nans += tl.sum((valid & (value != value)).to(tl.int32), axis=0)
    for start in range(0, budget, BLOCK):
        slot = start + lane
        tl.store(kept_row + slot, tl.full((BLOCK,), -1, dtype=tl.int64), mask=(slot >= taken) & (slot < budget))
    tl.store(nan_ptr + row, nans)


# ----------------------------------------------------------------------------------------------
# Launching: JIT, or the specializations the AOT build compiles
# ----------------------------------------------------------------------------------------------

# The run-time arguments of each kernel as the AOT build declares them (Triton's signature
# strings): the scalars are int32, as every size here fits one.
SIGNATURES: dict[str, dict[str, str]] = {
    "statistics": {"scores_ptr": "*fp32", "width_ptr": "*i64", "mean_ptr": "*fp32", "std_ptr": "*fp32",
                   "num_rows": "i32", "batch": "i32", "W": "i32"},
    "aggregate": {"scores_ptr": "*fp32", "mean_ptr": "*fp32", "std_ptr": "*fp32", "width_ptr": "*i64",
                  "layers_ptr": "*i32", "out_ptr": "*fp32", "batch": "i32", "W": "i32", "num_scored": "i32",
                  "out_rows": "i32"},
    "queue": {"scores_ptr": "*fp32", "width_ptr": "*i64", "mean_ptr": "*fp32", "std_ptr": "*fp32",
              "layers_ptr": "*i32", "out_ptr": "*fp32", "work_ptr": "*i32", "batch": "i32", "W": "i32",
              "num_scored": "i32", "out_rows": "i32"},
    "select": {"values_ptr": "*fp32", "width_ptr": "*i64", "P_ptr": "*i64", "kept_ptr": "*i64", "nan_ptr": "*i32",
               "rows_per_request": "i32", "W": "i32", "budget": "i32"},
}
KERNELS = {"statistics": _stats_kernel, "aggregate": _aggregate_kernel, "queue": _queue_kernel,
           "select": _select_kernel}
# Triton's defaults but the fusion and the warps (the host's tunables), stated so the JIT launches
# and the AOT build compile alike.
OPTIONS = {"num_stages": 3, "enable_fp_fusion": False}


def options(host: SelectionHost, kernel: str) -> dict[str, int | bool]:
    return {**OPTIONS, "num_warps": host.num_warps[kernel]}


def aot_specializations(host: SelectionHost) -> list[Specialization]:
    """Every kernel a family's selection launches, with exactly the constants of its JIT launch."""
    specs = [Specialization("statistics", _stats_kernel, SIGNATURES["statistics"], host.stats_constants(),
                            options(host, "statistics"))]
    specs += [Specialization(f"aggregate_{mode}", _aggregate_kernel, SIGNATURES["aggregate"],
                             host.aggregate_constants(mode), options(host, "aggregate")) for mode in MODES]
    # both routes are in every library: the bench times each stage apart, decide takes the tuned one
    specs += [Specialization(f"queue_{mode}", _queue_kernel, SIGNATURES["queue"], host.queue_constants(mode),
                             options(host, "queue")) for mode in MODES]
    specs.append(Specialization("select", _select_kernel, SIGNATURES["select"], host.select_constants(),
                                options(host, "select")))
    return specs


def aot_header_constants(host: SelectionHost) -> dict[str, int | list[int]]:
    """The family's constants ``select_abi.cpp`` reads (its names)."""
    return {"kNumLayers": host.num_layers, "kKvHeads": host.kv_heads, "kGroup": host.group,
            "kNumScored": len(host.scored_layers), "kRows": host.rows, "kBlockW": host.block_w, "kBlock": host.block,
            "kRadixBits": host.radix_bits, "kStatsUnroll": host.stats_unroll, "kStatsWarps": host.num_warps["statistics"],
            "kAggregateWarps": host.num_warps["aggregate"], "kStatsResident": host.stats_resident,
            "kSelectRoute": host.select_route, "kSelectWarps": host.num_warps["select"],
            "kAggregateRoute": host.aggregate_route, "kChunkRequests": host.chunk_requests,
            "kQueueLag": host.queue_lag, "kQueuePrograms": host.queue_programs, "kHeadStep": host.head_step,
            "kScoredLayers": list(host.scored_layers)}


class TritonSelector(SelectionHost):
    """``SelectionHost`` launching the kernels through Triton's JIT (compiled on the first call)."""

    def _launch_statistics(self, scores, width, mean, std, batch, W):  # noqa: ANN001, ANN202
        num_rows = mean.numel()
        _stats_kernel[(triton.cdiv(num_rows, self.rows),)](scores, width, mean, std, num_rows, batch, W,
                                                            **self.stats_constants(), **options(self, "statistics"))

    def _launch_aggregate(self, mode, scores, mean, std, width, layers, out, batch, W):  # noqa: ANN001, ANN202
        grid = (triton.cdiv(W, self.block_w), batch, 1 if mode == "union" else self.kv_heads)
        _aggregate_kernel[grid](scores, mean, std, width, layers, out, batch, W, len(self.scored_layers),
                                out.shape[1], **self.aggregate_constants(mode), **options(self, "aggregate"))

    def _launch_queue(self, mode, scores, width, mean, std, layers, out, work, batch, W):  # noqa: ANN001, ANN202
        # the interpreter's programs run one after the other: the first takes every ticket
        sms = torch.cuda.get_device_properties(scores.device).multi_processor_count if scores.is_cuda else 1
        _queue_kernel[(sms * self.queue_programs,)](scores, width, mean, std, layers, out, work, batch, W,
                                                    len(self.scored_layers), out.shape[1],
                                                    **self.queue_constants(mode), **options(self, "queue"))

    def _launch_select(self, values, width, P, kept, nan_rows, rows, W, budget):  # noqa: ANN001, ANN202
        _select_kernel[(kept.shape[0] * rows,)](values, width, P, kept, nan_rows, rows, W, budget,
                                                **self.select_constants(), **options(self, "select"))
