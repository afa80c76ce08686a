"""Trajectories and agent-aware KV residency (issue 10). Torch-free: the simulator runs this
package as it is, fed with what a live server would know at each moment."""
