"""The autotuner (``kvgen tune``), one module per stage, plain data between them:

``space`` (what is searched: declared tunables, canonical configurations, size buckets) ->
``candidates`` (build side: every candidate compiled through the build cache into a bundle) ->
``measure`` (GPU side: correctness gate against the oracle, CUDA-event timing, JSON lines) ->
``study`` (optuna studies per family/op/arch/bucket over those measurements, or live) ->
``configs`` (``tuning/<arch>/<family>.json``: written here, read by ``kvgen build``).
``run`` is the command; ``evidence`` compares the search with the exhaustive sweep; ``costmodel``
predicts candidates' times from their SASS for targets that cannot be measured here.
"""
