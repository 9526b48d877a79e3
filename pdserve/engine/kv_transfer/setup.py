"""Builds an engine's KV connector from its configuration: transport, layout, worker, sides.

Called once by ``LLMEngine`` at start-up. For the shm transport the KV cache itself
must live in shared memory, and so must a tensor-parallel engine's (rank 0 moves every
rank's heads), so this module also supplies the runner's allocator; the probes' scratch
buffer (one KV block, never part of the cache) lives in shared memory with shm too.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import os

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.kv_transfer.base import KVConnector
from pdserve.engine.kv_transfer.common import ConnectorTimeouts
from pdserve.engine.kv_transfer.dispatch import DispatchConnector
from pdserve.engine.kv_transfer.layout import KVLayout
from pdserve.engine.kv_transfer.transport import create_transport
from pdserve.engine.kv_transfer.worker import ConnectorWorker, Scratch


def kv_allocator(config: EngineConfig):
    """The runner's KV allocator for this transport and tensor parallelism (None:
    ordinary memory). With a transport and several ranks, one region holds every rank's
    slab (rank 0's first) and ``allocate.fd`` is its file for the other ranks to map
    (``parallel.TPWorkers.start_cache``); rank 0's connector moves them all."""
    ranks = config.tensor_parallel_size
    if config.kv_transport == "shm":
        from pdserve.engine.kv_transfer.transport.shm import allocate_shm_tensor

        def allocate(shape, dtype):
            # Peers map the segment by name: it is unlinked when the engine closes (and at
            # exit, so a crash-free shutdown leaves nothing in /dev/shm).
            shm = allocate_shm_tensor((ranks, *shape), dtype)
            allocate.segment = shm
            atexit.register(shm.close)
            if ranks > 1:
                allocate.fd = os.open(shm.path, os.O_RDWR)
            return shm.tensor[0]
    elif ranks > 1 and config.kv_transport != "none":
        from pdserve.engine.parallel import create_shared_kv

        def allocate(shape, dtype):
            tensor, allocate.fd = create_shared_kv((ranks, *shape), dtype)
            return tensor[0]
    else:
        return None
    allocate.segment = allocate.fd = None
    return allocate


def probe_scratch(config: EngineConfig, num_bytes: int) -> Scratch:
    """The buffer the probes' test transfer reads into (the transport registers it; no
    request ever uses it). With shm it is a /dev/shm segment too, unlinked at close."""
    if config.kv_transport == "shm":
        import torch

        from pdserve.engine.kv_transfer.transport.shm import allocate_shm_tensor

        shm = allocate_shm_tensor((num_bytes,), torch.uint8)
        atexit.register(shm.close)  # a crash-free exit without close leaves nothing either
        return Scratch(shm.tensor.data_ptr(), num_bytes, owner=shm, release=shm.close)
    buffer = bytearray(num_bytes)
    return Scratch(ctypes.addressof(ctypes.c_char.from_buffer(buffer)), num_bytes, owner=buffer)


def model_identity(config: EngineConfig, model_config: ModelConfig) -> str:
    """What must be the same model on both sides: checkpoint name and architecture."""
    arch = repr(sorted(model_config.__dict__.items()))
    return f"{config.model}:{hashlib.sha256(arch.encode()).hexdigest()[:12]}"


def build_connector(config: EngineConfig, model_config: ModelConfig, runner,
                    block_manager) -> KVConnector | None:
    """The engine's connector (None with ``kv_transport=none``); its KV region is registered
    with the transport here."""
    if config.kv_transport == "none":
        return None
    options = dict(host=config.kv_host, port=config.kv_port, auth_token=config.kv_auth_token,
                   timeout_s=config.kv_transfer_timeout_s)
    if config.kv_transport == "tcp":
        options["require_grants"] = True  # writes only into blocks reserved for the writer
    if config.kv_transport == "mooncake":  # RDMA where a NIC exists; refused where none does
        options.update(protocol=config.kv_mooncake_protocol,
                       device_names=config.kv_mooncake_devices)
    transport = create_transport(config.kv_transport, **options)
    kv = runner.kv_cache
    layout = KVLayout(
        model_id=model_identity(config, model_config),
        dtype=config.dtype,
        block_size=config.block_size,
        num_layers=model_config.num_hidden_layers,
        num_kv_heads=model_config.num_key_value_heads,
        head_dim=model_config.head_dim,
        dtype_bytes=kv.element_size(),
        num_blocks=runner.num_blocks,
        base_addr=kv.data_ptr(),  # rank 0's slab first: the region holds every rank's
        tp_size=config.tensor_parallel_size,
    )
    timeouts = ConnectorTimeouts(
        descriptor_s=config.kv_descriptor_timeout_s, done_s=config.kv_done_timeout_s,
        lease_s=config.kv_lease_s, abort_ack_s=config.kv_abort_ack_timeout_s,
        reserve_wait_s=config.kv_reserve_wait_s,
    )
    worker = ConnectorWorker(transport, layout, fault_send_delay_s=config.fault_kv_send_delay_s,
                             scratch=probe_scratch(config, layout.block_bytes))
    return DispatchConnector(worker, block_manager, timeouts, config.decode_allocation,
                             partial=config.kv_partial_transfer)
