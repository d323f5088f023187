"""The adaptive batch: the gradient noise scale the swarm measures, and the batch plan it sets for every epoch."""
