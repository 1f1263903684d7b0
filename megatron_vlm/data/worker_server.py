"""Imported by the DataLoader workers' fork server only (a preload named in worker_start.py; never import it
elsewhere: it makes the importing process ignore the stop signals).

Why: SLURM sends its stop request to every process of the job step. The workers ignore it (the rank stops at a
step boundary and ends them itself), and so must their server: a server ended by TERM makes every worker it
forked look dead to the DataLoader, which then raises wherever the rank is, its checkpoint save included. The
server still ends with the rank: it exits when the rank's end of its pipe closes.
"""
from megatron_vlm.stop_signals import leave_stop_signals_to_the_rank

leave_stop_signals_to_the_rank()
