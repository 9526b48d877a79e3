"""``pdserve bench``: a goodput benchmark for any OpenAI-compatible server.

The story of one run, module by module:
  - ``workload``: request classes (prompt source, output length, share, own arrival,
    SLO), from a YAML/JSON file or the built-in ``mixed``;
  - ``options``: flags on top of the workload (precedence written there);
  - ``prompts``: each class's concrete requests from its own seeded RNG;
  - ``loadgen``: arrival streams (Poisson, periodic, closed loop) under one budget;
  - ``client``: one streamed ``/v1/completions`` request, every chunk timestamped;
  - ``stats``: the pure metrics (TTFT, ITL, TPOT, E2E percentiles, goodput under SLO);
  - ``report`` and ``plots``: the JSON report, the terminal tables, the PNGs;
  - ``compare``: two ``pdserve up`` deployments, rounds A, B, A, B, ratios A/B;
  - ``cli``: the command itself.

Layering: this package imports only ``pdserve.api`` and third-party libraries; it
talks to pdserve over HTTP like any client, so it measures other servers the same way.
"""
