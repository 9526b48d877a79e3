/* The stand-in's per-Pod network identity, loaded into every container with LD_PRELOAD.
 *
 * Pods share the host's network namespace; each has its own loopback address
 * (STANDIN_POD_IP, one of 127.0.0.0/8, all of which Linux routes to lo). So that a
 * Pod behaves as if it had a network namespace of its own:
 *   bind()    to 0.0.0.0, ::, 127.0.0.1 or ::1 binds the Pod IP instead (wildcard
 *             listeners of two Pods on one port do not collide; a listener on
 *             "localhost" is the Pod's own);
 *   connect() to 127.0.0.1 or ::1 reaches the Pod IP (the Pod's own localhost).
 * Every other address is left alone. IPv6 sockets get the v4-mapped Pod IP.
 * Without STANDIN_POD_IP the shim changes nothing.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*socket_call)(int, const struct sockaddr *, socklen_t);

static struct in_addr pod_ip;
static int has_pod_ip = -1;

static int load_pod_ip(void) {
    if (has_pod_ip < 0) {
        const char *text = getenv("STANDIN_POD_IP");
        has_pod_ip = text != NULL && inet_pton(AF_INET, text, &pod_ip) == 1;
    }
    return has_pod_ip;
}

static int is_own_v4(struct in_addr addr, int with_wildcard) {
    uint32_t host = ntohl(addr.s_addr);
    return (with_wildcard && host == INADDR_ANY) || host == INADDR_LOOPBACK;
}

/* The address to use instead of addr, in buf, or addr itself when it is not the Pod's own. */
static const struct sockaddr *pod_address(const struct sockaddr *addr, socklen_t len,
                                          struct sockaddr_storage *buf, int with_wildcard) {
    if (addr == NULL || !load_pod_ip())
        return addr;
    if (addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
        const struct sockaddr_in *in4 = (const void *)addr;
        if (!is_own_v4(in4->sin_addr, with_wildcard))
            return addr;
        memcpy(buf, addr, sizeof *in4);
        ((struct sockaddr_in *)buf)->sin_addr = pod_ip;
        return (const void *)buf;
    }
    if (addr->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
        const struct sockaddr_in6 *in6 = (const void *)addr;
        struct in_addr mapped;
        memcpy(&mapped, &in6->sin6_addr.s6_addr[12], 4);
        int is_own = (with_wildcard && IN6_IS_ADDR_UNSPECIFIED(&in6->sin6_addr))
                     || IN6_IS_ADDR_LOOPBACK(&in6->sin6_addr)
                     || (IN6_IS_ADDR_V4MAPPED(&in6->sin6_addr) && is_own_v4(mapped, with_wildcard));
        if (!is_own)
            return addr;
        memcpy(buf, addr, sizeof *in6);
        struct in6_addr *out = &((struct sockaddr_in6 *)buf)->sin6_addr;
        memset(out, 0, sizeof *out);
        out->s6_addr[10] = out->s6_addr[11] = 0xff;
        memcpy(&out->s6_addr[12], &pod_ip, 4);
        return (const void *)buf;
    }
    return addr;
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static socket_call real_bind;
    struct sockaddr_storage buf;
    if (real_bind == NULL)
        real_bind = (socket_call)dlsym(RTLD_NEXT, "bind");
    return real_bind(fd, pod_address(addr, len, &buf, 1), len);
}

int connect(int fd, const struct sockaddr *addr, socklen_t len) {
    static socket_call real_connect;
    struct sockaddr_storage buf;
    if (real_connect == NULL)
        real_connect = (socket_call)dlsym(RTLD_NEXT, "connect");
    return real_connect(fd, pod_address(addr, len, &buf, 0), len);
}
