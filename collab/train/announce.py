"""What a trainer peer tells the others and the dashboard: its signed metrics record, republished every few
seconds and at each epoch (collab.train.trainer's PUBLISH_EVERY). collab.records.metrics says what each field
means and bounds it."""

from __future__ import annotations

import time
from typing import Optional

from collab.records.metrics import AveragingLog, PeerMetricsRecord, loss_for_record, publish, rate_for_record
from collab.train.plan_keeper import plan_fields
from collab.train.summary import Summary

METRICS_RECORD_LIFETIME = 300.0  # seconds a peer's metrics record lives in the DHT unless republished


def publish_metrics(opt, config, swarm, summary: Summary, log: AveragingLog, epoch_loss: Optional[float],
                    data=None) -> None:
    """Store this peer's metrics record. `opt`: its averaging mode (collab.modes); `swarm`: its DHT node
    (collab.swarm.node.Swarm); `epoch_loss`: the mean loss of its last whole epoch; `data`: its token-shard
    reader (collab.train.data_feed.PeerData), if the run has shards."""
    report = opt.mode_report()
    gossip = report.gossip
    record = PeerMetricsRecord(
        peer_id=swarm.peer_id,
        role="trainer",
        epoch=opt.local_epoch,
        loss=loss_for_record(epoch_loss),
        samples_per_second=rate_for_record(opt.tracker.performance_ema.samples_per_second),
        samples_contributed=summary.samples_contributed,
        target_batch_size=config.training.target_batch_size,
        client_mode=swarm.peer.client_mode,
        bandwidth_mbps=config.averaging.bandwidth,
        rounds_joined=log.joined,
        rounds_failed=log.failed,
        last_group_size=log.last_group_size,
        time=time.time(),
        batches_dropped=sum(summary.batches_dropped.values()),
        rejected=opt.rejections.for_record(),
        **dict(zip(("mb_per_round", "fewer_bytes_than_fp32"), opt.traffic.per_round())),
        mode=config.averaging.mode,
        inner_steps=report.inner_steps,
        pseudo_gradient_norm=report.pseudo_gradient_norm,
        **(dict(merges_per_minute=gossip["merges_per_minute"], merge_update_norm=gossip["last_update_norm"],
                param_norm=gossip["param_norm"], param_sketch=gossip["sketch"]) if gossip else {}),
        **report.noise,
        **plan_fields(opt.plan_keeper, opt.local_epoch, config.training),
        **(data.record_fields() if data is not None else {}),
    )
    publish(swarm.dht, swarm.peer.run_id, swarm.public_key, record, METRICS_RECORD_LIFETIME)
