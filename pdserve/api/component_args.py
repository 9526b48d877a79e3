"""The PDCluster spec as a component's command line: one pure function per mapping,
shared by ``pdserve up`` (local processes) and the operator (Deployments), so both
run exactly the spec.

Owns ``coordinator_argv`` (served and tokenizer model, routing policies, KV mode,
fallback policy, local-prefill rules, block size, TTFT and TPOT SLOs, request
timeouts) and ``model_location``
(where components find the weights or tokenizer).

Invariants: pure (no I/O, no environment); only the listen address and the
Controller address differ between local mode and Kubernetes, and they are
arguments.
"""

from __future__ import annotations

from pdserve.api.cluster import PDCluster, PDClusterSpec

MODEL_DIR = "/models"
"""Where the operator mounts pvc and image model sources in every Pod."""


def model_location(spec: PDClusterSpec) -> str:
    """A preset name, a checkpoint directory, or the mount path of a pvc/image source."""
    model = spec.model
    if model.preset or model.path:
        return model.preset or model.path
    return f"{MODEL_DIR}/" + (model.pvc.sub_path if model.pvc else "")


def coordinator_argv(cluster: PDCluster, host: str, port: int, controller: str) -> list[str]:
    """``pdserve`` arguments of a Coordinator serving ``cluster`` on ``host:port``,
    watching the Controller at ``controller``. Called by ``pdserve up`` and the
    operator's Coordinator Deployment builder."""
    spec = cluster.spec
    argv = ["coordinator", "--host", host, "--port", str(port),
            "--controller", controller,
            "--cluster-name", cluster.metadata.name,
            "--model", model_location(spec),
            "--served-model-name", spec.model.served_name or cluster.metadata.name,
            "--prefill-policy", spec.routing.prefill_policy,
            "--decode-policy", spec.routing.decode_policy,
            "--kv-mode", spec.kv_transfer.mode,
            "--local-prefill-max-tokens", str(spec.routing.local_prefill_max_tokens),
            "--move-stalled-s", f"{spec.routing.move_stalled_seconds:g}",
            "--fallback-policy", spec.fallback.policy,
            "--block-size", str(spec.engine.block_size), "--dtype", spec.engine.dtype,
            "--first-token-timeout-s", str(spec.timeouts.first_token_seconds),
            "--token-idle-timeout-s", str(spec.timeouts.token_idle_seconds)]
    if spec.timeouts.request_seconds:
        argv += ["--request-timeout-s", str(spec.timeouts.request_seconds)]
    if spec.slo.ttft_ms:
        argv += ["--ttft-slo-s", f"{spec.slo.ttft_ms / 1000:g}"]
    if spec.slo.tpot_ms:
        argv += ["--tpot-slo-s", f"{spec.slo.tpot_ms / 1000:g}"]
    if not spec.routing.load_aware_local_prefill:
        argv.append("--no-load-aware-local-prefill")
    return argv
