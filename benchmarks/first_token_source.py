"""How much earlier a PD request's first token reaches the client because it goes out
with P's message of it, not D's.

D's message of the first token comes once D has the KV and its loop finished the step
it was in (the engine's ``decode_queue`` stage); P's as soon as P sampled it. The
Coordinator hands on whichever comes first, so per request the saving is what D's
side would have taken (route + D's wait for the KV + D's queue, from the request's
``x-pdserve-timings``) less the TTFT the Coordinator measured. Requests that ran on one
engine (a short prompt prefilled on D) have no D side and are left out.

    pdserve up -f examples/bench-smollm2-pd.yaml --port 8041
    python benchmarks/first_token_source.py http://127.0.0.1:8041 48 16   # URL, requests, concurrency
"""

import asyncio
import random
import statistics
import sys

import httpx

URL = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8041"
MODEL = "bench-smollm2-pd"
WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud"]


async def one(client: httpx.AsyncClient, i: int) -> dict:
    words = " ".join(random.Random(i).choice(WORDS) for _ in range(90))
    body = {"model": MODEL, "prompt": words, "max_tokens": 48, "ignore_eos": True, "temperature": 0}
    r = await client.post(URL + "/v1/completions", json=body, headers={"x-pdserve-timings": "1"},
                          timeout=120)
    return r.json()["pdserve_timings"]


async def main(n: int, concurrency: int) -> None:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient() as client:
        async def bounded(i: int) -> dict:
            async with sem:
                return await one(client, i)

        reports = await asyncio.gather(*[bounded(i) for i in range(n)])
    pd = [t for t in reports if "decode_queue_s" in t]
    saved = [t["route_s"] + t["decode_wait_s"] + t["decode_queue_s"] - t["ttft_s"] for t in pd]
    queue = [t["decode_queue_s"] for t in pd]
    ttft = [t["ttft_s"] for t in reports]
    print(f"c={concurrency} PD requests {len(pd)}/{n}: TTFT p50 {statistics.median(ttft) * 1e3:.0f} ms; "
          f"D's queue mean {statistics.mean(queue) * 1e3:.0f} ms; the first token earlier than "
          f"D's by mean {statistics.mean(saved) * 1e3:.0f} ms, p50 {statistics.median(saved) * 1e3:.0f} ms, "
          f"max {max(saved) * 1e3:.0f} ms")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[2]), int(sys.argv[3])))
