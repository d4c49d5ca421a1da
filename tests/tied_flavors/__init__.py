"""A test-only plugin (`model.plugin = "tests.tied_flavors"`): the tiny flavours of the families that can tie their
output projection to the embedding, tied, registered as families of their own (`<family>_tied`), so that a tied model
trains at test sizes (the built-in tied flavours are 1B-sized)."""

import dataclasses

from meshloom.models.registry import MODEL_REGISTRY, get_model_spec, register_model

get_model_spec("llama3")  # registers the built-in families
TIEABLE = sorted(
    name
    for name, spec in MODEL_REGISTRY.items()
    if "tiny" in spec.flavors and "tie_embeddings" in {f.name for f in dataclasses.fields(spec.flavors["tiny"])}
)

for _name in TIEABLE:
    _spec = MODEL_REGISTRY[_name]
    if f"{_name}_tied" not in MODEL_REGISTRY:
        register_model(
            dataclasses.replace(
                _spec, name=f"{_name}_tied", flavors={"tiny": dataclasses.replace(_spec.flavors["tiny"], tie_embeddings=True)}
            )
        )
