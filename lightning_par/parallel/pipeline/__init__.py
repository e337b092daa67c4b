"""Pipeline parallel, one file per part:

- ``split.py``: where the stages are and how each is built from the model map (the schedules are
  ``torch.distributed.pipelining``'s; stage arithmetic and the schedule table in ``lightning_par.layout.schedules``);
- ``trace.py``: what the network does outside its blocks, from one traced forward;
- ``runner.py``: a training or evaluation step through the stages;
- ``weight_grad.py``: the weight-gradient half of backward, deferred (zero-bubble schedules);
- ``bubble.py``: the idle share of each rank, measured;
- ``ties.py``: parameters several stages hold, kept equal.
"""
