"""What a search reports: the MLflow tracking of every run (:mod:`.tracking`), the exported policy files
(:mod:`.export`), the study's dashboard (:mod:`.dashboard`) and the search's terminal tables and end screen
(:mod:`.search_view`)."""
