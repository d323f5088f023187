"""hivemind's internals behind one door: every hivemind method collab overrides, every run-time patch, every private
name it reads, listed here, with the parameters collab was written against.

The package holds the hooks themselves:
- `allreduce.RunnerHooks`, `averager.AveragerHooks`, `optimizer.OptimizerHooks` and `optimizer.TrackerHooks` are the
  only classes that define a private hivemind method (or an averaging RPC handler). Each hands over to a public
  method whose default is hivemind's own behaviour; collab's classes derive from these and override the public
  names, so a class elsewhere in collab never names a private hivemind method.
- `patches` holds every run-time patch of a hivemind module, class or object, and every call of a private hivemind
  function, one function each, with one line on why; `matchmaking`, those of hivemind's Matchmaking (per averager).
Public methods collab's classes override (a constructor, `step`, a codec's `extract`) are listed here too.

tests/unit/test_hivemind_hooks.py checks this list against the installed hivemind and against collab's own classes
and sources: a hivemind upgrade that renames, removes or re-signs one of these names fails there, loudly, in one
place; so does an override or a patch added anywhere else. Why each hook exists: docs/design.md, "hivemind hooks".
This module imports nothing: the test resolves the names.
"""

from __future__ import annotations

import inspect

HIVEMIND_VERSION = "1.1.12"  # the version these were read from (pyproject.toml pins it)

# hivemind method (module.Class.method) -> its parameters: names, kinds and defaults (annotations left out)
OVERRIDDEN = {
    "hivemind.averaging.allreduce.AllReduceRunner.__init__":
        "self, *, p2p, servicer_type, prefix, group_id, tensors, weight=None, ordered_peer_ids, peer_fractions, "
        "modes=None, sender_timeout=None, reducer_timeout=None, **kwargs",
    "hivemind.averaging.allreduce.AllReduceRunner._accumulate_parts_streaming": "self, stream, sender_index",
    "hivemind.averaging.allreduce.AllReduceRunner._communicate_with_peer": "self, peer_id",
    "hivemind.averaging.allreduce.AllReduceRunner._generate_input_for_peer": "self, peer_index",
    "hivemind.averaging.allreduce.AllReduceRunner._get_peer_stub": "self, peer",
    "hivemind.averaging.allreduce.AllReduceRunner.rpc_aggregate_part": "self, stream, context",
    "hivemind.averaging.averager.DecentralizedAverager.__init__":
        "self, averaged_tensors, dht, *, start, prefix, target_group_size=None, min_group_size=2, "
        "initial_group_bits='', min_matchmaking_time=5.0, request_timeout=3.0, averaging_alpha=1.0, "
        "part_size_bytes=524288, allreduce_timeout=None, next_chunk_timeout=None, sender_timeout=None, "
        "reducer_timeout=None, compression=hivemind.NoCompression(), state_compression=hivemind.NoCompression(), "
        "tensor_infos=None, bandwidth=None, min_vector_size=0, auxiliary=False, allow_state_sharing=None, "
        "declare_state_period=30, client_mode=None, daemon=True, shutdown_timeout=5",
    "hivemind.averaging.averager.DecentralizedAverager._aggregate_with_group":
        "self, group_info, min_vector_size, **kwargs",
    "hivemind.averaging.averager.DecentralizedAverager._load_state_from_peers": "self, future, timeout=None",
    "hivemind.averaging.averager.DecentralizedAverager._run_allreduce_inplace_":
        "self, tensors, group_info, group_id=None, **kwargs",
    "hivemind.averaging.averager.DecentralizedAverager._shutdown": "self, timeout",
    "hivemind.averaging.averager.DecentralizedAverager.shutdown": "self",
    "hivemind.averaging.averager.DecentralizedAverager._step": "self, *, step, future_for_init",
    "hivemind.averaging.averager.DecentralizedAverager.load_state_from_peers": "self, wait=True, timeout=None",
    "hivemind.averaging.averager.DecentralizedAverager.rpc_aggregate_part": "self, stream, context",
    "hivemind.averaging.averager.DecentralizedAverager.run_in_background": "self, await_ready=True, timeout=None",
    "hivemind.averaging.averager.DecentralizedAverager.rpc_download_state": "self, _request, _context",
    "hivemind.averaging.averager.DecentralizedAverager.rpc_join_group": "self, request, context",
    "hivemind.averaging.averager.DecentralizedAverager.state_sharing_priority": "self",
    "hivemind.averaging.averager.DecentralizedAverager.step":
        "self, gather=None, scheduled_time=None, weight=None, timeout=None, allow_retries=True, "
        "require_trigger=False, wait=True",
    "hivemind.averaging.partition.TensorPartReducer.__init__": "self, part_shapes, num_senders",
    "hivemind.averaging.partition.TensorPartReducer.accumulate_part":
        "self, sender_index, part_index, tensor_part, weight=1.0",
    "hivemind.averaging.partition.TensorPartReducer.check_current_part_finished": "self",
    "hivemind.averaging.partition.TensorPartReducer.finalize": "self",
    "hivemind.averaging.partition.TensorPartReducer.reset_accumulators": "self",
    "hivemind.compression.adaptive.AdaptiveCompressionBase.choose_compression": "self, info",
    "hivemind.compression.base.CompressionBase.compress": "self, tensor, info, allow_inplace=False",
    "hivemind.compression.base.CompressionBase.estimate_compression_ratio": "self, info",
    "hivemind.compression.base.CompressionBase.extract": "self, serialized_tensor",
    "hivemind.compression.quantization.BlockwiseQuantization.extract": "self, serialized_tensor",
    "hivemind.compression.quantization.Quantization.extract": "self, serialized_tensor",
    "hivemind.dht.dht.DHT.__init__":
        "self, initial_peers=None, *, start, p2p=None, daemon=True, num_workers=4, record_validators=(), "
        "shutdown_timeout=3, await_ready=True, **kwargs",
    "hivemind.dht.dht.DHT.run": "self",
    "hivemind.averaging.averager.DecentralizedAverager.run": "self",
    # the public validator API (collab.records.verdicts wraps the run's validators)
    "hivemind.dht.validation.RecordValidatorBase.merge_with": "self, other",
    "hivemind.dht.validation.RecordValidatorBase.sign_value": "self, record",
    "hivemind.dht.validation.RecordValidatorBase.strip_value": "self, record",
    "hivemind.dht.validation.RecordValidatorBase.validate": "self, record",
    "hivemind.optim.grad_averager.GradientAverager.__init__":
        "self, parameters, *, dht, prefix, reuse_grad_buffers=False, accumulate_grads_on=None, client_mode=None, "
        "warn=True, averaged_grads=(), **kwargs",
    "hivemind.optim.grad_averager.GradientAverager.accumulate_grads_": "self, batch_size",
    "hivemind.optim.grad_averager.GradientAverager.load_accumulators_into_averager_": "self",
    "hivemind.optim.grad_averager.GradientAverager.reset_accumulated_grads_": "self",
    "hivemind.optim.grad_averager.GradientAverager.schedule_step": "self, scheduled_time=None, **kwargs",
    "hivemind.optim.optimizer.Optimizer.__init__":
        "self, *, dht, run_id, target_batch_size, batch_size_per_step=None, optimizer, params=None, "
        "scheduler=None, matchmaking_time=15.0, averaging_timeout=60.0, allreduce_timeout=None, "
        "next_chunk_timeout=None, load_state_timeout=600.0, reuse_grad_buffers=False, offload_optimizer=None, "
        "delay_optimizer_step=None, delay_grad_averaging=False, delay_state_averaging=True, "
        "average_state_every=1, use_local_updates=False, client_mode=None, auxiliary=False, "
        "grad_compression=hivemind.NoCompression(), grad_averager_factory=None, "
        "state_averaging_compression=hivemind.NoCompression(), load_state_compression=hivemind.NoCompression(), "
        "average_opt_statistics=(), extra_tensors=(), averager_opts=None, tracker_opts=None, "
        "performance_ema_alpha=0.1, shutdown_timeout=5, verbose=False",
    "hivemind.optim.optimizer.Optimizer._average_gradients_and_load_into_optimizer": "self, maybe_step_control",
    "hivemind.optim.optimizer.Optimizer._begin_averaging_gradients": "self, grad_scaler",
    "hivemind.optim.optimizer.Optimizer._load_averaged_gradients_into_optimizer_": "self",
    "hivemind.optim.optimizer.Optimizer._load_local_gradients_into_optimizer": "self",
    "hivemind.optim.optimizer.Optimizer._make_progress_tracker": "self, target_batch_size, **kwargs",
    "hivemind.optim.optimizer.Optimizer._make_state_averager": "self, **kwargs",
    "hivemind.optim.optimizer.Optimizer._maybe_schedule_gradient_averaging": "self",
    "hivemind.optim.optimizer.Optimizer._maybe_schedule_state_averaging": "self",
    "hivemind.optim.optimizer.Optimizer._should_load_state_from_peers": "self",
    "hivemind.optim.optimizer.Optimizer._tag_along_with_zero_weight": "self, control",
    "hivemind.optim.optimizer.Optimizer._update_global_epoch": "self, grad_scaler",
    "hivemind.optim.optimizer.Optimizer.load_state_from_peers": "self, **kwargs",
    "hivemind.optim.optimizer.Optimizer.shutdown": "self",
    "hivemind.optim.optimizer.Optimizer.step": "self, closure=None, batch_size=None, grad_scaler=None",
    "hivemind.optim.optimizer.Optimizer.zero_grad": "self, set_to_none=True",
    "hivemind.optim.power_sgd_averager.PowerSGDGradientAverager.__init__":
        "self, parameters, averager_rank, *, dht, prefix, reuse_grad_buffers=False, accumulate_grads_on=None, "
        "client_mode=None, warn=True, min_compression_ratio=0.5, averaged_grads=None, **kwargs",
    "hivemind.optim.power_sgd_averager.PowerSGDGradientAverager._aggregate_with_group":
        "self, group_info, min_vector_size, **kwargs",
    "hivemind.optim.progress_tracker.ProgressTracker.__init__":
        "self, dht, prefix, target_batch_size, *, client_mode=None, min_refresh_period=0.5, "
        "max_refresh_period=10, default_refresh_period=3, expected_drift_peers=3, expected_drift_rate=0.2, "
        "performance_ema_alpha=0.1, metadata_expiration=60.0, status_loglevel=10, private_key=None, daemon=True, "
        "start",
    "hivemind.optim.progress_tracker.ProgressTracker._parse_swarm_progress_data": "self, metadata",
    "hivemind.optim.progress_tracker.ProgressTracker._progress_reporter": "self",
    "hivemind.optim.progress_tracker.ProgressTracker.shutdown": "self, timeout=None",
    "hivemind.optim.progress_tracker.ProgressTracker.ready_to_update_epoch": "self",
    "hivemind.optim.progress_tracker.ProgressTracker.report_local_progress":
        "self, local_epoch, samples_accumulated, update_global_samples=True",
    "hivemind.optim.state_averager.TrainingStateAverager.__init__":
        "self, *, dht, optimizer, params=None, scheduler=None, initialize_optimizer=None, "
        "offload_optimizer=False, custom_gradients=False, reuse_tensors=None, delta_rule_averaging=False, "
        "performance_ema_alpha=0.1, sync_epoch_when_averaging=False, parameter_names=None, "
        "average_opt_statistics=(), extra_tensors=(), status_loglevel=10, **kwargs",
    "hivemind.optim.state_averager.TrainingStateAverager.get_current_state": "self",
    "hivemind.optim.state_averager.TrainingStateAverager.load_state_from_peers": "self, **kwargs",
    "hivemind.optim.state_averager.TrainingStateAverager.step":
        "self, wait_for_delayed_updates=None, apply_delayed_updates=True, increment_epoch=False, "
        "optimizer_step=False, zero_grad=False, delay_optimizer_step=False, averaging_round=False, "
        "delay_averaging=None, averaging_control=None, wait_for_trigger=None, grad_scaler=None, set_to_none=True,"
        " averaging_opts=None",
    "hivemind.utils.auth.TokenAuthorizerBase.__init__": "self, local_private_key=None",
    "hivemind.utils.auth.TokenAuthorizerBase.does_token_need_refreshing": "self, access_token",
    "hivemind.utils.auth.TokenAuthorizerBase.get_token": "self",
    "hivemind.utils.auth.TokenAuthorizerBase.is_token_valid": "self, access_token",
}

# module-level names, class attributes and methods collab replaces, wraps or calls: only in collab.hivemind_hooks
PATCHED = (
    "hivemind.averaging.allreduce.deserialize_torch_tensor",  # collab's decoders (fixed 8-bit, DGC's sparse parts)
    "hivemind.utils.crypto.RSAPrivateKey._process_wide_key",  # the tracker signs with the libp2p identity's key
    "hivemind.utils.crypto.RSAPublicKey.from_bytes",  # reads collab's Ed25519 keys too (records, access tokens)
    "hivemind.p2p.PeerID.from_identity",  # reads Ed25519 identity files too (P2P.create's is_identity_taken)
    "hivemind.averaging.matchmaking.Matchmaking._request_join_group",  # never ask a banned leader
    "hivemind.averaging.matchmaking.Matchmaking.look_for_group",  # each search for a group timed
    "hivemind.averaging.matchmaking.PotentialLeaders.pop_next_leader",  # the planned leader asked first
    "hivemind.averaging.matchmaking.Matchmaking._check_reasons_to_reject",  # a planned leader's earlier followers
    "hivemind.averaging.key_manager.GroupKeyManager.get_averagers",  # group reads paced
    "hivemind.averaging.partition.TensorPartContainer.register_failed_reducer",  # reducers that died mid-round
    "hivemind.averaging.partition.TensorPartContainer.register_processed_part",  # every returned part checked
    "hivemind.dht.protocol.DHTProtocol.get_stub",  # a peer's DHT requests counted (requests, bytes)
    # a store's walk asks for the key's twin (the same nodes, no values), with a beam of 5, not 20, by default
    "hivemind.dht.node.DHTNode.store_many",
    "hivemind.dht.node.DHTNode._call_find_with_blacklist",
    "hivemind.dht.node.DHTNode.find_nearest_nodes",  # a store's walk skipped where one found the key's nodes just now
    "hivemind.dht.node.DHTNode.get",  # a key's latest values read once for every reader (collab.records.shared_reads)
    "hivemind.dht.node._SearchState",  # a read from a key's nearest replicas alone, merged as get merges
    "hivemind.p2p.servicer.ServicerBase.get_stub",  # a state download's donors: members, plausible, dialled bounded
    "hivemind.averaging.allreduce.AllReduceRunner._ban_sender",  # called by collab's reducer loop (one_average)
    "hivemind.dht.dht.DHT._get_p2p_daemon_listen_maddr",  # a second client of the DHT's p2pd (run files)
    "hivemind.p2p.p2p_daemon.P2P._terminate",  # that client closed, the daemon left to the DHT
    "hivemind.p2p.p2p_daemon.P2P.create",  # a p2pd that failed to start: its socket file removed; the identity
    # check's p2pd (is_identity_taken, which names no startup_timeout) given the peer's startup_timeout
    "hivemind.dht.node.DHTNode.create",  # a DHT node that failed to start: the p2pd it started shut down
    "hivemind.utils.mpfuture.MPFuture._active_futures",  # rounds cancelled on a signal
    "hivemind.utils.mpfuture.MPFuture.reset_backend",  # the fork server's forks
    # process-shared locks a killed holder no longer leaves held (collab.hivemind_hooks.locks)
    "hivemind.utils.mpfuture.MPFuture._update_lock",
    "hivemind.utils.mpfuture.MPFuture._initialization_lock",
    "hivemind.utils.mpfuture.SharedBytes._lock",
    "hivemind.utils.asyncio._AsyncContextWrapper.EXECUTOR_LOCK",
    "hivemind.utils.asyncio._AsyncContextWrapper.__aenter__",  # a cancelled enter exits what its thread entered
    "hivemind.optim.state_averager.TrainingStateAverager._update_scheduler",  # a lineage split's epoch adopted
)

# hivemind names collab's role modules read (a constant, a StepControl's state) or call (a public method of an
# internal class): no patch, but an upgrade that changes them changes collab
READ = (
    "hivemind.compression.quantization._BLOCKWISE_QUANTIZATION_BLOCKSIZE",  # decoding a blockwise part
    "hivemind.averaging.control.StepControl.deadline",  # a pre-scheduled round's time left
    "hivemind.averaging.control.StepControl.stage",
    "hivemind.averaging.control.StepControl.data_for_gather",  # a gradient round's epoch (its group key)
    "hivemind.averaging.control.StepControl.attach",  # a leaving peer's step ended before _step (end_step_unstarted)
    "hivemind.dht.protocol.DHTProtocol.call_ping",  # lost peers pinged back (rejoin)
    "hivemind.averaging.allreduce.AllReduceRunner.finalize",  # a running all-reduce ended on a signal or revocation
    "hivemind.averaging.matchmaking.Matchmaking.is_looking_for_group",  # asked before searching (woken_leader)
)

# attributes hivemind sets on its objects (self.NAME = ...) that collab reads or writes, by the class that sets them
INSTANCE_ATTRIBUTES = {
    # a leave asks whether it has room before a send (dht_takes_requests); reads wait for whole messages
    "hivemind.dht.dht.DHT": ("_outer_pipe", "_inner_pipe"),
    "hivemind.p2p.p2p_daemon.P2P": ("_daemon_listen_maddr",),  # a failed start's socket file, removed
    "hivemind.dht.node.DHTNode": ("_should_shutdown_p2p",),  # whether a failed start's p2pd is its own
    "hivemind.averaging.averager.DecentralizedAverager": (
        "_outer_pipe", "_inner_pipe", "_running_groups", "_averaging_alpha", "_state_updated", "_p2p", "_matchmaking",
        "_averaged_tensors", "_parent_pid"),
    "hivemind.optim.grad_averager.GradientAverager": ("_accumulators_used_in_step", "_anchor_batch_size"),
    "hivemind.optim.power_sgd_averager.PowerSGDGradientAverager": ("_ms", "_qs", "_uncompressed_gradients_indexes"),
    "hivemind.averaging.allreduce.AllReduceRunner": ("tensor_part_container", "tensor_part_reducer", "sender_peer_ids",
                                                     "active_senders", "parts_for_local_averaging", "banned_senders",
                                                     "_future"),
    "hivemind.averaging.partition.TensorPartContainer": ("num_parts_by_peer", "_input_parts_by_peer", "compression"),
    "hivemind.averaging.partition.TensorPartReducer": ("current_part_future", "sender_failed_after",
                                                       "num_parts_received"),
    "hivemind.optim.progress_tracker.ProgressTracker": ("should_report_progress", "global_progress",
                                                        "global_state_updated", "shutdown_triggered", "local_progress",
                                                        "training_progress_key", "_local_public_key",
                                                        "metadata_expiration"),
    "hivemind.dht.routing.RoutingTable": ("peer_id_to_uid",),
    "hivemind.optim.state_averager.TrainingStateAverager": ("step_executor", "lock_optimizer"),
    "hivemind.averaging.matchmaking.Matchmaking": ("group_key_manager", "min_matchmaking_time", "target_group_size",
                                                   "potential_leaders", "client_mode", "request_timeout",
                                                   "was_accepted_to_group", "current_leader", "assembled_group",
                                                   "peer_id", "current_followers",
                                                   "_servicer_type"),  # each leader's first answer heard
    "hivemind.averaging.matchmaking.PotentialLeaders": ("min_matchmaking_time", "declared_expiration_time"),
    "hivemind.averaging.key_manager.GroupKeyManager": ("prefix",),  # one group key per epoch (EpochGroups)
    "hivemind.utils.crypto.RSAPrivateKey": ("_private_key",),
    "hivemind.utils.crypto.RSAPublicKey": ("_public_key",),
    "hivemind.utils.asyncio._AsyncContextWrapper": ("_context",),  # what a cancelled enter must exit
}


def describe(function) -> str:
    """A function's parameters as an override or a call relies on them: names, kinds and defaults."""
    described, keyword_only = [], False
    for p in inspect.signature(function).parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            described.append("*" + p.name)
            keyword_only = True
        elif p.kind is p.VAR_KEYWORD:
            described.append("**" + p.name)
        else:
            if p.kind is p.KEYWORD_ONLY and not keyword_only:
                described.append("*")
                keyword_only = True
            described.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return ", ".join(described)
