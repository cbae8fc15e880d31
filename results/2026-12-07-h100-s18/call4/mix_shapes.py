"""s18 call 4: is the mix ceiling's expanding kernel (kvgen.measure.mix) the fastest way to move
decode's bytes? The same expansion (qwen3-8b decode: 274 rows of 1.27 MiB read, 4.5 MiB written)
at more words a program and more warps, plus a read-only anchor (a row-sum of 2 GiB), against the
device copy ceiling of this run. Writes mix_shapes.json to argv[1]."""
import json
import sys

import torch
import triton
import triton.language as tl

from kvgen.measure.timing import copy_ceiling, summary, time_ms


@triton.jit
def _expand(src, dst, SRC_WORDS: tl.constexpr, DST_WORDS: tl.constexpr, PASSES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = k < SRC_WORDS
    x = tl.load(src + row * SRC_WORDS + k, mask=live)
    for r in tl.static_range(PASSES):
        j = r * SRC_WORDS + k
        tl.store(dst + row * DST_WORDS + j, x, mask=live & (j < DST_WORDS))


@triton.jit
def _read(src, out, N, BLOCK: tl.constexpr):
    k = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + tl.program_id(0), tl.sum(tl.load(src + k, mask=k < N, other=0), axis=0))


def main(out: str) -> None:
    copy = copy_ceiling()
    gbps_copy = copy["gbps_read_plus_write"]
    res = {"copy": copy, "runs": []}
    rows, s_bytes, d_bytes = 274, 1327104, 4718592
    sw, dw = s_bytes // 4, d_bytes // 4
    src = torch.randint(-2**31, 2**31 - 1, (rows, sw), dtype=torch.int32, device="cuda")
    dst = torch.empty(rows, dw, dtype=torch.int32, device="cuda")
    for block in (512, 1024, 2048, 4096):
        for warps in (2, 4, 8, 16):
            if block // (32 * warps) < 4:
                continue
            f = lambda: _expand[(rows, triton.cdiv(sw, block))](src, dst, sw, dw, triton.cdiv(dw, sw), block,
                                                             num_warps=warps)
            t = time_ms(f, reps=20)
            gbps = rows * (s_bytes + d_bytes) / t["median_ms"] / 1e6
            r = {"kind": "expand", "block": block, "warps": warps, "gbps": gbps, "of_copy": gbps / gbps_copy, **summary(t)}
            print(r, flush=True)
            res["runs"].append(r)
    res["expand_checked"] = bool(torch.equal(dst[:, :sw], src) and torch.equal(dst[:, sw:2 * sw], src))
    del src, dst
    torch.cuda.empty_cache()
    n = 1 << 29
    buf = torch.randint(0, 7, (n,), dtype=torch.int32, device="cuda")
    for block, warps in ((4096, 8), (8192, 8), (8192, 16)):
        part = torch.empty(triton.cdiv(n, block), dtype=torch.int32, device="cuda")
        t = time_ms(lambda: _read[(triton.cdiv(n, block),)](buf, part, n, block, num_warps=warps), reps=20)
        gbps = 4 * n / t["median_ms"] / 1e6
        r = {"kind": "read", "block": block, "warps": warps, "gbps": gbps, "of_copy": gbps / gbps_copy, **summary(t)}
        print(r, flush=True)
        res["runs"].append(r)
    json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
