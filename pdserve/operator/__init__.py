"""kopf operator: reconciles PDCluster/PDInstance into Kubernetes objects."""
