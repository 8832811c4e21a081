"""The dashboard's page template and style (``evomerge.dashboards``); generated pages go to ``dashboards/<study>/``."""
