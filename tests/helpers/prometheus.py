"""Reading Prometheus text exposition in tests."""


def parse_values(text: str) -> dict[str, float]:
    """{'name{labels}': value} of every sample line (comments skipped)."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values
