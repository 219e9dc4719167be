"""A stage's state at rest and in transit: checkpoint files, what a checkpoint of a stage holds, saving and resuming,
and the state a peer serves to others and adopts from them."""
