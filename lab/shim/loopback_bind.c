/*
 * Preloaded (LD_PRELOAD) into the labs' processes so that every socket they bind to
 * "any address" binds to loopback instead.
 *
 * NIXL 1.5.1's metadata listener (the socket behind sendLocalMD / fetchRemoteMD) and
 * the KV event publisher and replay socket of every Dynamo mocker (`tcp://0.0.0.0:P`,
 * 1.4 to 1.6) bind INADDR_ANY and have no setting to change it; the lab machines must
 * keep every socket on 127.0.0.1. UCX is pinned with UCX_NET_DEVICES=lo; this covers
 * the rest. A bind to a specific address is left alone.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    static bind_fn real_bind;
    if (!real_bind) {
        real_bind = (bind_fn)dlsym(RTLD_NEXT, "bind");
    }
    if (addr && addr->sa_family == AF_INET && len >= sizeof(struct sockaddr_in)) {
        struct sockaddr_in in4;
        memcpy(&in4, addr, sizeof in4);
        if (in4.sin_addr.s_addr == htonl(INADDR_ANY)) {
            in4.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            return real_bind(fd, (const struct sockaddr *)&in4, sizeof in4);
        }
    } else if (addr && addr->sa_family == AF_INET6 && len >= sizeof(struct sockaddr_in6)) {
        struct sockaddr_in6 in6;
        memcpy(&in6, addr, sizeof in6);
        if (memcmp(&in6.sin6_addr, &in6addr_any, sizeof in6addr_any) == 0) {
            in6.sin6_addr = in6addr_loopback;
            return real_bind(fd, (const struct sockaddr *)&in6, sizeof in6);
        }
    }
    return real_bind(fd, addr, len);
}
