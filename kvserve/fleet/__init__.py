"""The fleet: engine replicas behind one gateway (Ray Serve). `routing` is the pure replica-choice policy."""
