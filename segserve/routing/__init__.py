"""Request routing rules shared by the real deployment (Ray Serve) and the simulator; no torch, no Ray."""
