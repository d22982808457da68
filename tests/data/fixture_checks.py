"""What the fixture scripts of this folder assert before they write a fixture.

A fixture is compared on another CPU, whose kernels may round differently: its decisions
must come from floats far from their thresholds, or that rounding could flip them.
"""

#: How far (relative to eta) every check's ratio must keep from eta: many orders of
#: magnitude beyond rounding (about 1e-6 relative).
MARGIN = 0.2


def check_clear_of_threshold(checks, eta: float, margin: float = MARGIN) -> None:
    """Raise unless every finite ratio of ``checks`` (a rule's history: per check, per
    layer, a ``ratio``) keeps ``margin * eta`` from ``eta``."""
    for check in checks:
        for name, layer in check["layers"].items():
            ratio = layer["ratio"]
            if ratio is not None and abs(ratio - eta) < margin * eta:
                raise AssertionError(
                    f"check {check} of {name}: ratio {ratio} is within {margin:.0%} of eta "
                    f"{eta}; another CPU's rounding could flip its decision"
                )
