"""The run in a browser (FastAPI): collector (DHT -> snapshot), routes, static page.

It serves collab.swarm.state.RunState, the same object `collab status --json` prints.
"""
