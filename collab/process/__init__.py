"""One collab process's life: what it sets before anything else, the ports it checks, signals, a bounded
shutdown, and the reaper that takes down everything it started."""
