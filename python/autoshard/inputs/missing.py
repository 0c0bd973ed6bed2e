"""The error raised where autoshard cannot make the example inputs a forward needs."""


HOW_TO_PASS = ("pass example_inputs=(tensor, ...) for positional arguments (a single tensor also works) or "
               "example_inputs={\"name\": tensor, ...} for keyword arguments; any device, only their shapes, "
               "dtypes and values are used, on meta copies")


class MissingInputs(ValueError):
    """autoshard cannot make the example inputs a model's forward needs; `reason` is why, without
    the advice on passing them."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason or message
