"""Tensor parallelism: one model across several devices, over ``mx.distributed``.

Every rank loads the model and keeps its slice of the language model (``shard.py``);
rank 0 serves HTTP and runs the scheduler; each turn it sends the turn's inputs to the
other ranks over a control channel (``control.py``), and they run the same scheduler
code on them (``replica.py``), so every rank takes the same steps with the same shapes
and the model's all-reduces match. ``group.py`` joins a group a launcher started
(``launch.py`` for ``--tensor-parallel N`` on one machine, or ``mlx.launch``);
``serve.py`` is a rank's life; ``random_weights.py`` makes benchmark models too large
to write to disk.
"""
