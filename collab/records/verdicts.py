"""Each DHT record checked once: the run's record validators, with their verdicts remembered.

A read of a dictionary key (the run's progress, its metrics) walks the DHT, and every node the walk reaches answers
with every record it holds under the key; hivemind checks each one (the signature over it, then the schema's
pydantic parse). A read therefore checks N records times the nodes that answered, and most of those are the same
records again: the same bytes from the next node, or from the last read, in which the record had not changed yet.
Sampled in one of 12 linreg peers' DHT processes (py-spy, 2 cores), those checks were a third of the process's CPU.

The verdict of hivemind's validators (RSASignatureValidator, SchemaValidator) is a function of the record alone
(key, subkey, value and expiration time: what the signature covers), so a record seen before is answered from
memory. Adding a validator (hivemind's progress tracker adds its schema at start) forgets every verdict. What is
remembered is bounded (REMEMBERED records and REMEMBERED_BYTES of them, the oldest forgotten first: a record may be
as large as a signed manifest, 256 KB), so a peer that floods the DHT with distinct records only makes this peer
check them, as it did before.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

from hivemind.dht.validation import CompositeValidator, DHTRecord, RecordValidatorBase

REMEMBERED = 4096  # records: a progress or metrics record is ~0.3-2 KB with its key and signature
REMEMBERED_BYTES = 16 * 2**20  # and at most this much of them (key, subkey and value) per DHT process


class RememberedVerdicts(RecordValidatorBase):
    """hivemind's CompositeValidator over `validators`, whose verdict on a record already seen is not computed again.

    Given to hivemind.DHT as its only record validator; validators added later (DHT.add_validators) merge into it
    (`merge_with`), so every record still passes all of them, in hivemind's order."""

    def __init__(self, validators: Iterable[RecordValidatorBase] = (), remember: int = REMEMBERED,
                 remember_bytes: int = REMEMBERED_BYTES):
        self.inner = CompositeValidator(validators)
        self.remember, self.remember_bytes = remember, remember_bytes
        self._verdicts: OrderedDict[DHTRecord, bool] = OrderedDict()
        self._bytes = 0  # of the records remembered
        self.checked = 0  # records the validators ran on
        self.remembered = 0  # records answered from memory

    def validate(self, record: DHTRecord) -> bool:
        verdict = self._verdicts.get(record)
        if verdict is not None:
            self._verdicts.move_to_end(record)
            self.remembered += 1
            return verdict
        verdict = bool(self.inner.validate(record))
        self.checked += 1
        self._verdicts[record] = verdict
        self._bytes += _size(record)
        while len(self._verdicts) > self.remember or self._bytes > self.remember_bytes:
            self._bytes -= _size(self._verdicts.popitem(last=False)[0])
        return verdict

    def sign_value(self, record: DHTRecord) -> bytes:
        return self.inner.sign_value(record)

    def strip_value(self, record: DHTRecord) -> bytes:
        return self.inner.strip_value(record)

    def merge_with(self, other: RecordValidatorBase) -> bool:
        """Every validator added later joins the inner ones, and the verdicts made without it are forgotten."""
        self.inner.extend([other])
        self._verdicts.clear()
        self._bytes = 0
        return True

    def counts(self) -> dict:
        return {"checked": self.checked, "remembered": self.remembered}


def _size(record: DHTRecord) -> int:
    return len(record.key) + len(record.subkey) + len(record.value)
