"""accordion: adaptive gradient compression for data-parallel PyTorch training.

Implements Accordion (Agarwal et al., MLSys 2021): compress mildly in critical learning
regimes and aggressively elsewhere. Modules:

* ``accordion.compress`` -- compressors, error-feedback memory and transports;
* ``accordion.accounting`` -- floats and bytes sent, per tensor and per layer;
* ``accordion.costmodel`` -- alpha-beta predictions of communication time;
* ``accordion.policy`` -- the critical-regime rule and its schedule (pure logic);
* ``accordion.models`` -- the paper's models.
"""

__version__ = "0.1.0"
