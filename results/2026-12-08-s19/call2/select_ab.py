"""s19 call 2: qwen3-8b's selection at B32 x 16384 columns, main library against its size variant,
on the same scores, alternating (the registry's libraries; kept sets compared too)."""
import json
import sys

import torch

from kvgen.measure.timing import summary, time_ms
from kvgen.runtime.lookup import RuntimeRegistry
from kvgen.runtime.select import Selector

registry, out = sys.argv[1], sys.argv[2]
selector = Selector(RuntimeRegistry([registry]).resolve("qwen3-8b", "sm_90a").dispatch("select"), "qwen3-8b")
main, (variant,) = selector.module, selector.variants
g = main
scores = torch.randn(len(g.scored_layers), 32, g.query_heads, 16384, device="cuda") * 3
width = torch.full((32,), 16384, dtype=torch.int64, device="cuda")
P = torch.zeros(32, dtype=torch.int64, device="cuda")
same = torch.equal(main.decide(scores, width, P, 2048, "union").check(),
                   variant.decide(scores, width, P, 2048, "union").check())
rows = []
for rep in range(3):
    for name, module in (("main", main), ("variant", variant)):
        t = time_ms(lambda m=module: m.decide(scores, width, P, 2048, "union"), reps=20, warmup=3)
        rows.append({"rep": rep, "library": name, **summary(t)})
        print(name, rep, round(t["median_ms"], 4))
json.dump({"served_by_b32": str(selector.path_for(32, 16384)), "kept_identical": same, "rows": rows},
          open(out, "w"), indent=1)
