"""What runs inside hivemind's averager processes: rounds another peer cannot poison, how a part is reduced,
gradient codecs, reply streams, traffic accounting, and state downloads checked before they are loaded."""
