"""tierserve's command line: the composition root that wires gateway and worker together."""
