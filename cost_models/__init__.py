"""Cost models: hardware catalog, cluster description and cost estimates."""
