"""The run around the training loop: `run` (`TrainingRun`) and the step's figures (`telemetry`),
which together with a recipe say everything a step does; and what they call: the optimizer and
schedule (`optim`), crash-safe checkpoints and preemption (`checkpoint`), the output folder and
what the run writes into it (`outputs`), the other ranks of a launch (`peers`), the Hub (`hub`)."""
