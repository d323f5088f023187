"""A DHT record checked once: remembered verdicts are the validators' own, for exactly the bytes they judged."""

from __future__ import annotations

import dataclasses
import time

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.serializer import MSGPackSerializer

from collab.records.metrics import METRICS_SUFFIX, MetricsSchema, PeerMetricsRecord
from collab.records.verdicts import RememberedVerdicts
from tests.conftest import METRICS_RECORD

RUN = "verdicts"


def signed_record(verdicts: RememberedVerdicts, signature: RSASignatureValidator, **fields) -> DHTRecord:
    """A metrics record as a DHT node stores it: key id, serialized subkey (the signer's key), signed value."""
    value = {**PeerMetricsRecord(**METRICS_RECORD).dict(), **fields}
    record = DHTRecord(DHTID.generate(source=RUN + METRICS_SUFFIX).to_bytes(),
                       MSGPackSerializer.dumps(signature.local_public_key), MSGPackSerializer.dumps(value),
                       time.time() + 60)
    return dataclasses.replace(record, value=verdicts.sign_value(record))


class Counting(RecordValidatorBase):
    def __init__(self, verdict: bool = True):
        self.verdict, self.calls = verdict, 0

    def validate(self, record: DHTRecord) -> bool:
        self.calls += 1
        return self.verdict


def make(remember: int = 100, remember_bytes: int = 2**20):
    signature, counting = RSASignatureValidator(RSAPrivateKey()), Counting()
    verdicts = RememberedVerdicts([SchemaValidator(MetricsSchema, prefix=RUN), signature, counting], remember,
                                  remember_bytes)
    return verdicts, signature, counting


def test_a_record_seen_again_is_not_checked_again_and_keeps_its_verdict():
    verdicts, signature, counting = make()
    record = signed_record(verdicts, signature)
    assert verdicts.validate(record) and verdicts.validate(dataclasses.replace(record))  # equal bytes, a new object
    assert counting.calls == 1 and verdicts.counts() == {"checked": 1, "remembered": 1}
    assert verdicts.strip_value(record) == MSGPackSerializer.dumps(PeerMetricsRecord(**METRICS_RECORD).dict())  # the signature stripped


def test_a_forged_or_replayed_record_is_judged_on_its_own_bytes():
    verdicts, signature, _ = make()
    record = signed_record(verdicts, signature)
    assert verdicts.validate(record)
    epoch = MSGPackSerializer.dumps(3)
    forged = dataclasses.replace(record, value=record.value.replace(b"epoch" + epoch, b"epoch" + MSGPackSerializer.dumps(9)))
    assert forged.value != record.value
    prolonged = dataclasses.replace(record, expiration_time=record.expiration_time + 3600)  # the signature covers it
    for _ in range(2):  # and the rejection is remembered as a rejection
        assert not verdicts.validate(forged) and not verdicts.validate(prolonged)
    assert verdicts.counts() == {"checked": 3, "remembered": 2}
    absurd = signed_record(verdicts, signature, peer_id=7)  # signed by its owner, but outside the schema
    assert not verdicts.validate(absurd) and not verdicts.validate(absurd)


def test_a_validator_added_later_judges_every_record_again():
    verdicts, signature, _ = make()
    record = signed_record(verdicts, signature)
    assert verdicts.validate(record)
    refusing = Counting(verdict=False)
    assert verdicts.merge_with(refusing)  # what hivemind's DHT.add_validators does through its CompositeValidator
    assert not verdicts.validate(record) and refusing.calls == 1


def test_what_is_remembered_is_bounded_oldest_first():
    verdicts, signature, counting = make(remember=2)
    first, second, third = (signed_record(verdicts, signature, epoch=epoch) for epoch in (1, 2, 3))
    for record in (first, second, third, third, first):
        assert verdicts.validate(record)
    assert counting.calls == 4 and len(verdicts._verdicts) == 2  # first was forgotten when third came, then checked


def test_what_is_remembered_is_bounded_in_bytes_too():
    verdicts, signature, counting = make(remember_bytes=3000)  # two metrics records with key and subkey, not three
    records = [signed_record(verdicts, signature, epoch=epoch) for epoch in range(4)]
    assert 1000 < len(records[0].key) + len(records[0].subkey) + len(records[0].value) < 1500
    for record in records:
        assert verdicts.validate(record)
    assert len(verdicts._verdicts) == 2 and verdicts._bytes <= 3000
    assert verdicts.validate(records[0]) and counting.calls == 5  # forgotten, so checked again
