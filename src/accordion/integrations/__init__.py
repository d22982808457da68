"""Accordion inside the training frameworks: one module per framework.

Each is imported on its own, so that ``import accordion`` never imports a framework
(install them with ``pip install torch-accordion[integrations]``):

* ``accordion.integrations.lightning`` -- PyTorch Lightning;
* ``accordion.integrations.accelerate`` -- Hugging Face Accelerate;
* ``accordion.integrations.transformers`` -- the Hugging Face ``Trainer``.

All of them register the hook through :meth:`accordion.ddp.AccordionState.register`,
which finds the ``DistributedDataParallel`` module that the framework built. FSDP2's
hybrid sharding is in :mod:`accordion.fsdp`. See ``docs/integrations.md``.
"""
