"""Checkpoints: the Accordion state's format, and consistent sets for a whole job.

* :mod:`accordion.checkpoint.format` -- the format of ``AccordionState.state_dict()``
  (``FORMAT``, reading older formats, checking who wrote a file);
* :mod:`accordion.checkpoint.sets` -- :class:`Checkpointer`: atomic, consistent
  checkpoint sets of every rank (model, optimizer, scheduler, Accordion state, batch
  controller, RNG, the loop's position), the newest complete one found on resume,
  a changed world size handled (:mod:`accordion.checkpoint.reshard`);
* :mod:`accordion.checkpoint.rendezvous` -- :func:`init_process_group`: a ``torchrun``
  worker's process group through a file rendezvous per restart attempt, in the
  checkpoint folder (gloo's env:// rendezvous often fails after a restart).
"""

from .format import FORMAT, READABLE, check_owner, upgrade
from .rendezvous import init_process_group
from .sets import Checkpointer, Restored

__all__ = ["FORMAT", "READABLE", "check_owner", "upgrade", "Checkpointer", "Restored",
           "init_process_group"]  # fmt: skip
