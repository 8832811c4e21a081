"""Study files and named policies shipped with evomerge (this folder is the package ``evomerge.studies``)."""
