"""The cost profile of a device: how long the target's verify forward, the drafter's block forward and a
round's bookkeeping take there (`costs.Costs`, the JSON `scoring.costs` reads), measured with real forwards
of the real models (`timing.profile_costs`, `dflash-callbacks profile`), and the timed speculative decoding
the predicted speed-ups are checked against (`decode`)."""
