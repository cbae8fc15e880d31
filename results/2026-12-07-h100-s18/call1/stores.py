"""s18 call 1: does the store flavour change how fast DRAM takes a write-heavy mix?

Decode of qwen3-8b reads a cold record and writes a hot page 3.56x its size. kvgen.measure.mix
times that mix with plain stores (0.85 of copy on the s17 H100). Here the same expanding kernel
with every store flavour Triton exposes (cache modifier x eviction policy), plus the write-only and
1:1 anchors, all against the device copy ceiling of this run. Writes stores.json to argv[1].
"""
import json
import sys

import torch
import triton
import triton.language as tl

from kvgen.measure.timing import copy_ceiling, summary, time_ms

BLOCK = 1024


@triton.jit
def _expand(src, dst, SRC_WORDS: tl.constexpr, DST_WORDS: tl.constexpr, PASSES: tl.constexpr, BLOCK: tl.constexpr,
            CM: tl.constexpr, EP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = k < SRC_WORDS
    x = tl.load(src + row * SRC_WORDS + k, mask=live)
    for r in tl.static_range(PASSES):
        j = r * SRC_WORDS + k
        tl.store(dst + row * DST_WORDS + j, x, mask=live & (j < DST_WORDS), cache_modifier=CM, eviction_policy=EP)


@triton.jit
def _fill(dst, N, BLOCK: tl.constexpr, CM: tl.constexpr):
    k = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + k, tl.zeros([BLOCK], tl.int32), mask=k < N, cache_modifier=CM)


def main(out: str) -> None:
    copy = copy_ceiling()
    copy_gbps = copy["gbps_read_plus_write"]
    res = {"copy": copy, "runs": []}
    rows, s_bytes, d_bytes = 274, 1327104, 4718592          # qwen3-8b decode, s17 call2
    sw, dw = s_bytes // 4, d_bytes // 4
    src = torch.randint(-2**31, 2**31 - 1, (rows, sw), dtype=torch.int32, device="cuda")
    dst = torch.empty(rows, dw, dtype=torch.int32, device="cuda")
    passes = triton.cdiv(dw, sw)
    for cm in ("", ".cs", ".cg", ".wt", ".wb"):
        for ep in ("", "evict_first", "evict_last"):
            for warps in (4, 8):
                try:
                    f = lambda: _expand[(rows, triton.cdiv(sw, BLOCK))](src, dst, sw, dw, passes, BLOCK, cm, ep,
                                                                    num_warps=warps)
                    t = time_ms(f, reps=20)
                    gbps = rows * (s_bytes + d_bytes) / t["median_ms"] / 1e6
                    r = {"kind": "expand", "cm": cm, "ep": ep, "warps": warps, "gbps": gbps, "of_copy": gbps / copy_gbps,
                         **summary(t)}
                except Exception as e:  # a flavour this Triton refuses is a record, not a stop
                    r = {"kind": "expand", "cm": cm, "ep": ep, "warps": warps, "error": repr(e)[:300]}
                print(r, flush=True)
                res["runs"].append(r)
    ok = torch.equal(dst[:, :sw], src) and torch.equal(dst[:, sw:2 * sw], src)
    res["expand_checked"] = bool(ok)
    del src, dst
    torch.cuda.empty_cache()
    n = 1 << 29                                              # 2 GiB of int32 written
    buf = torch.empty(n, dtype=torch.int32, device="cuda")
    for cm in ("", ".cs", ".wt"):
        t = time_ms(lambda: _fill[(triton.cdiv(n, 2048),)](buf, n, 2048, cm, num_warps=8), reps=20)
        gbps = 4 * n / t["median_ms"] / 1e6
        r = {"kind": "fill", "cm": cm, "gbps": gbps, "of_copy": gbps / copy_gbps, **summary(t)}
        print(r, flush=True)
        res["runs"].append(r)
    t = time_ms(lambda: buf.zero_(), reps=20)
    gbps = 4 * n / t["median_ms"] / 1e6
    res["runs"].append({"kind": "torch_zero", "gbps": gbps, "of_copy": gbps / copy_gbps, **summary(t)})
    print(res["runs"][-1], flush=True)
    json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
