"""Suite-wide set-up: the ranks of every launched job start with the example models imported."""

from autopar.runtime import launch

# transformers and the example zoo take a second or two to import: once in the fork server, not per rank
launch.PRELOAD.append("examples.models")
