"""Kubernetes metadata: which pod and container a process or an accelerator belongs to.

Pod lists come from the kubelet, the API server or KubeEdge's edge MetaServer
(client.py, pods.py); device assignments from the kubelet's pod-resources
socket (pod_resources.py). metadata.py refreshes both in a background thread
and hands the sampler an immutable view (view.py). Without Kubernetes the view
is empty and every pod label is ''.
"""
