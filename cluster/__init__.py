"""oscar.cluster: Ray stage actors, placement, job entrypoints, cluster launcher / KubeRay YAML."""
