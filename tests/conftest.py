"""Suite-wide set-up: the ranks of every launched job start with the example models imported."""

from autopar.runtime import launch
from examples import families

# transformers and the example zoo take a second or two to import: once in the fork server, not per rank
launch.PRELOAD.append("examples.models")
# transformers imports a family's modelling code when it is first built (1.4 s for the first, in every rank
# of every launch): the fork server imports those of the families the tests build
launch.PRELOAD += [f"transformers.models.{name}.modeling_{name}" for name in [*families.FAMILIES, "resnet"]]
