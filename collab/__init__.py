"""collab: train one model together over the internet, on hivemind.

Nothing is started at import time: the DHT, averagers and p2pd only start inside
`collab join` (collab.train.trainer.run) or when a caller asks for them explicitly.
"""

__version__ = "0.2.1"
