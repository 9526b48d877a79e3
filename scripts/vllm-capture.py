"""Records what vLLM answers pdserve's vLLM backend, as the unit tests' fixtures
(tests/data/vllm/): run against a prefill and a decode server started by
scripts/vllm-serve.sh, with the project's venv:

    python scripts/vllm-capture.py P_ADDRESS D_ADDRESS tests/data/vllm

Each exchange is saved as NAME.request.json (the body sent) and NAME.response
(the raw bytes answered: JSON, or the SSE stream as it came) with NAME.status.
Prompts are token ids of SmolLM2's tokenizer.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx

PROMPT = [504, 3575, 282, 4649, 314]  # "The capital of France is"
LOGPROBS = {"logprobs": 2, "return_tokens_as_token_ids": True}


def main() -> None:
    p, d, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    out.mkdir(parents=True, exist_ok=True)
    client = httpx.Client(timeout=120)

    def exchange(name: str, address: str, body: dict | None, method: str = "POST",
                 path: str = "/v1/completions", headers: dict | None = None) -> bytes:
        if body is not None:
            (out / f"{name}.request.json").write_text(json.dumps(body) + "\n")
        response = client.request(method, f"http://{address}{path}", json=body, headers=headers)
        (out / f"{name}.response").write_bytes(response.content)
        (out / f"{name}.status").write_text(f"{response.status_code}\n")
        print(name, response.status_code, len(response.content), "bytes")
        return response.content

    base = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    exchange("single_stream", d, {**base, "stream": True, **LOGPROBS},
             headers={"X-Request-Id": "single-1"})
    exchange("single_whole", d, {**base, "stream": False, "prompt_logprobs": 1, **LOGPROBS},
             headers={"X-Request-Id": "single-2"})
    prefill = json.loads(exchange(
        "prefill", p, {**base, "max_tokens": 1, "stream": False, **LOGPROBS,
                       "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}},
        headers={"X-Request-Id": "pd-1"}))
    exchange("decode_stream", d, {**base, "stream": True, **LOGPROBS,
                                  "kv_transfer_params": prefill["kv_transfer_params"]},
             headers={"X-Request-Id": "pd-1"})
    exchange("bad_request", d, {**base, "prompt": [10**9], "stream": True})
    exchange("too_long", d, {**base, "prompt": [100] * 2100, "stream": True})
    exchange("health", d, None, "GET", "/health")
    exchange("models", d, None, "GET", "/v1/models")
    exchange("metrics", d, None, "GET", "/metrics")


if __name__ == "__main__":
    main()
