/* libplugin_FABRIC.so: fabric as a NIXL backend ("FABRIC"), on fabric's C API (fabric.h).
 *
 *   NIXL agent                     this plugin                     fabric (libfabric_c.a)
 *   registerMem(DRAM/VRAM)     ->  fabric_register                 region, descriptor
 *   getPublicData              ->  the region's descriptor bytes
 *   getConnInfo                ->  fabric_engine_address
 *   loadRemoteConnInfo(agent)  ->  fabric_add_peer                 agent <-> peer id
 *   loadRemoteMD / loadLocalMD ->  fabric_remote_new               (our own engine for local)
 *   prepXfer                   ->  the batch's entries, resolved once per request
 *   postXfer                   ->  fabric_batch (one operation for every descriptor)
 *   checkXfer                  ->  fabric_op_test; once the data is done, the notification
 *                                  (fabric_send) and then NIXL_SUCCESS
 *   genNotif / getNotifs       ->  fabric_send / fabric_try_recv
 *
 * A notification is a message [agent name length: u32 LE][agent name][payload]; the
 * receiver needs no mapping from peer ids to names. A notification of a transfer is sent
 * only once the transfer's operation has finished, so the bytes are in place before the
 * target sees it (fabric's messages are not ordered with its writes).
 *
 * Backend parameters: provider (tcp), nics (comma-separated), domains (0: 2 on tcp, else one
 * per NIC), mode
 * (inline|event|adaptive|busy_poll), op_timeout_ms (30000), max_msg_size (131072), cuda_ipc
 * (-1), chunk (0: 1 MiB).
 * docs/nixl.md is the guide. */

#include <chrono>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "backend/backend_engine.h"
#include "backend/backend_plugin.h"
#include "fabric.h"

namespace {

const char *kName = "FABRIC";
const char *kVersion = "0.1.0";

nixl_status_t to_nixl(fabric_status s) {
    switch (s) {
    case FABRIC_STATUS_OK:
        return NIXL_SUCCESS;
    case FABRIC_STATUS_IN_PROGRESS:
        return NIXL_IN_PROG;
    case FABRIC_STATUS_ERR_INVALID:
    case FABRIC_STATUS_ERR_OUT_OF_BOUNDS:
    case FABRIC_STATUS_ERR_MESSAGE_TOO_LARGE:
    case FABRIC_STATUS_ERR_BUFFER_TOO_SMALL:
        return NIXL_ERR_INVALID_PARAM;
    case FABRIC_STATUS_ERR_UNKNOWN_PEER:
        return NIXL_ERR_NOT_FOUND;
    case FABRIC_STATUS_ERR_PEER_UNREACHABLE:
    case FABRIC_STATUS_ERR_CONNECTION_LOST:
        return NIXL_ERR_REMOTE_DISCONNECT;
    case FABRIC_STATUS_ERR_MALFORMED:
    case FABRIC_STATUS_ERR_FOREIGN:
    case FABRIC_STATUS_ERR_STALE:
        return NIXL_ERR_MISMATCH;
    case FABRIC_STATUS_ERR_UNSUPPORTED:
        return NIXL_ERR_NOT_SUPPORTED;
    default:
        return NIXL_ERR_BACKEND;
    }
}

/* Logs a failed fabric call and gives NIXL's code for it. */
nixl_status_t fail(const char *what, fabric_status s) {
    NIXL_ERROR << what << ": " << fabric_status_name(s) << ": " << fabric_last_error();
    return to_nixl(s);
}

/* Registered local memory. */
struct LocalMD : nixlBackendMD {
    fabric_region *region = nullptr;
    uintptr_t base = 0;
    size_t len = 0;
    LocalMD() : nixlBackendMD(true) {}
    ~LocalMD() override { fabric_region_free(region); }
};

/* A peer's (or our own, for local transfers) registered memory. */
struct RemoteMD : nixlBackendMD {
    fabric_remote *remote = nullptr;
    uintptr_t base = 0;
    size_t len = 0;
    RemoteMD() : nixlBackendMD(false) {}
    ~RemoteMD() override { fabric_remote_free(remote); }
};

/* One request: its entries, resolved by prepXfer, and the operations of its last post. */
struct Request : nixlBackendReqH {
    fabric_batch_op op = FABRIC_BATCH_OP_WRITE;
    std::vector<fabric_batch_entry> entries;
    fabric_op *data = nullptr;
    fabric_op *notif = nullptr;
    bool has_notif = false;
    uint32_t peer = 0;
    bool local = false; /* within this agent */
    std::string message;     /* the notification's message to a peer, made at post */
    std::string local_notif; /* or its payload, for a transfer within this agent */
    fabric_status failed = FABRIC_STATUS_OK; /* a failure waiting to be named (see checkXfer) */
    std::chrono::steady_clock::time_point failed_at;
    ~Request() override {
        fabric_op_free(data);
        fabric_op_free(notif);
    }
};

class FabricEngine : public nixlBackendEngine {
public:
    explicit FabricEngine(const nixlBackendInitParams *init) : nixlBackendEngine(init) {
        fabric_engine_options o;
        fabric_engine_options_init(&o);
        provider_ = param("provider", "tcp");
        nics_ = param("nics", "");
        o.provider = provider_.c_str();
        o.nics = nics_.empty() ? nullptr : nics_.c_str();
        o.domains = static_cast<uint32_t>(std::stoul(param("domains", "0")));
        if (o.domains == 0 && nics_.empty() && provider_ == "tcp") {
            /* Two connections per peer, transfers sharded over them: through NIXL's client on
             * one H200 host this took 1 MiB x 64 WRITEs from 0.56-0.72x of UCX's (which puts
             * over several lanes) to 0.92-1.02x, READs from 2.4x to 3-4x (docs/nixl.md). */
            o.domains = 2;
        }
        const std::string mode = param("mode", "inline");
        if (mode == "event") {
            o.mode = FABRIC_MODE_EVENT;
        } else if (mode == "adaptive") {
            o.mode = FABRIC_MODE_ADAPTIVE;
        } else if (mode == "busy_poll") {
            o.mode = FABRIC_MODE_BUSY_POLL;
        } else if (mode == "inline") {
            o.mode = FABRIC_MODE_INLINE;
        } else {
            NIXL_ERROR << "FABRIC: mode must be inline, event, adaptive or busy_poll, not " << mode;
            initErr = true;
            return;
        }
        o.op_timeout_ms = std::stoull(param("op_timeout_ms", "30000"));
        o.max_msg_size = static_cast<uint32_t>(std::stoul(param("max_msg_size", "131072")));
        o.cuda_ipc = std::stoi(param("cuda_ipc", "-1"));
        o.chunk_bytes = std::stoull(param("chunk", "0"));
        fabric_status s = fabric_engine_new(&o, &engine_);
        if (s != FABRIC_STATUS_OK) {
            fail("FABRIC: fabric_engine_new", s);
            initErr = true;
            return;
        }
        recv_buf_.resize(fabric_engine_max_msg_size(engine_));
        NIXL_INFO << "FABRIC: engine on " << fabric_engine_transport(engine_) << " for agent " << localAgent;
    }

    ~FabricEngine() override { fabric_engine_free(engine_); }

    bool supportsRemote() const override { return true; }
    bool supportsLocal() const override { return true; }
    bool supportsNotif() const override { return true; }
    nixl_mem_list_t getSupportedMems() const override { return {DRAM_SEG, VRAM_SEG}; }

    nixl_status_t registerMem(const nixlBlobDesc &mem, const nixl_mem_t &kind, nixlBackendMD *&out) override {
        if (kind != DRAM_SEG && kind != VRAM_SEG) return NIXL_ERR_NOT_SUPPORTED;
        int32_t device = kind == VRAM_SEG ? static_cast<int32_t>(mem.devId) : -1;
        auto md = new LocalMD();
        fabric_status s = fabric_register(engine_, reinterpret_cast<void *>(mem.addr), mem.len, device, &md->region);
        if (s != FABRIC_STATUS_OK) {
            delete md;
            return fail("FABRIC: registerMem", s);
        }
        md->base = mem.addr;
        md->len = mem.len;
        out = md;
        return NIXL_SUCCESS;
    }

    nixl_status_t deregisterMem(nixlBackendMD *meta) override {
        delete static_cast<LocalMD *>(meta);
        return NIXL_SUCCESS;
    }

    nixl_status_t getPublicData(const nixlBackendMD *meta, std::string &str) const override {
        auto md = static_cast<const LocalMD *>(meta);
        size_t len = 0;
        fabric_region_descriptor(md->region, nullptr, 0, &len);
        str.resize(len);
        fabric_status s =
            fabric_region_descriptor(md->region, reinterpret_cast<uint8_t *>(str.data()), str.size(), &len);
        return s == FABRIC_STATUS_OK ? NIXL_SUCCESS : fail("FABRIC: getPublicData", s);
    }

    nixl_status_t getConnInfo(std::string &str) const override {
        size_t len = 0;
        fabric_engine_address(engine_, nullptr, 0, &len);
        str.resize(len);
        fabric_status s = fabric_engine_address(engine_, reinterpret_cast<uint8_t *>(str.data()), str.size(), &len);
        return s == FABRIC_STATUS_OK ? NIXL_SUCCESS : fail("FABRIC: getConnInfo", s);
    }

    nixl_status_t loadRemoteConnInfo(const std::string &agent, const std::string &info) override {
        uint32_t peer = 0;
        fabric_status s =
            fabric_add_peer(engine_, reinterpret_cast<const uint8_t *>(info.data()), info.size(), &peer);
        if (s != FABRIC_STATUS_OK) return fail("FABRIC: loadRemoteConnInfo", s);
        std::lock_guard<std::mutex> g(lock_);
        peers_[agent] = peer;
        return NIXL_SUCCESS;
    }

    nixl_status_t connect(const std::string &agent) override {
        if (agent == localAgent) return NIXL_SUCCESS;
        uint32_t peer = 0;
        if (!peer_of(agent, peer)) return NIXL_ERR_NOT_FOUND;
        fabric_status s = fabric_peer_status(engine_, peer);
        return s == FABRIC_STATUS_OK ? NIXL_SUCCESS : fail("FABRIC: connect", s);
    }

    nixl_status_t disconnect(const std::string &agent) override {
        uint32_t peer = 0;
        {
            std::lock_guard<std::mutex> g(lock_);
            auto it = peers_.find(agent);
            if (it == peers_.end()) return NIXL_SUCCESS;
            peer = it->second;
            peers_.erase(it);
        }
        fabric_status s = fabric_remove_peer(engine_, peer);
        return s == FABRIC_STATUS_OK ? NIXL_SUCCESS : fail("FABRIC: disconnect", s);
    }

    nixl_status_t loadRemoteMD(const nixlBlobDesc &input, const nixl_mem_t &, const std::string &,
                               nixlBackendMD *&output) override {
        auto md = new RemoteMD();
        fabric_status s = fabric_remote_new(engine_, reinterpret_cast<const uint8_t *>(input.metaInfo.data()),
                                            input.metaInfo.size(), &md->remote);
        if (s != FABRIC_STATUS_OK) {
            delete md;
            return fail("FABRIC: loadRemoteMD", s);
        }
        md->base = input.addr;
        md->len = input.len;
        output = md;
        return NIXL_SUCCESS;
    }

    nixl_status_t loadLocalMD(nixlBackendMD *input, nixlBackendMD *&output) override {
        /* Our own region as a remote one: local transfers go through the engine like any
         * other (it is a peer of itself). */
        auto local = static_cast<LocalMD *>(input);
        std::string desc;
        nixl_status_t st = getPublicData(local, desc);
        if (st != NIXL_SUCCESS) return st;
        auto md = new RemoteMD();
        fabric_status s = fabric_remote_new(engine_, reinterpret_cast<const uint8_t *>(desc.data()), desc.size(),
                                            &md->remote);
        if (s != FABRIC_STATUS_OK) {
            delete md;
            return fail("FABRIC: loadLocalMD", s);
        }
        md->base = local->base;
        md->len = local->len;
        output = md;
        return NIXL_SUCCESS;
    }

    nixl_status_t unloadMD(nixlBackendMD *input) override {
        delete static_cast<RemoteMD *>(input);
        return NIXL_SUCCESS;
    }

    nixl_status_t prepXfer(const nixl_xfer_op_t &operation, const nixl_meta_dlist_t &local,
                           const nixl_meta_dlist_t &remote, const std::string &agent, nixlBackendReqH *&handle,
                           const nixl_opt_b_args_t *) const override {
        const int n = local.descCount();
        if (n != remote.descCount()) {
            NIXL_ERROR << "FABRIC: prepXfer: " << n << " local and " << remote.descCount() << " remote descriptors";
            return NIXL_ERR_INVALID_PARAM;
        }
        auto req = new Request();
        req->op = operation == NIXL_READ ? FABRIC_BATCH_OP_READ : FABRIC_BATCH_OP_WRITE;
        req->entries.reserve(n);
        for (int i = 0; i < n; i++) {
            const nixlMetaDesc &l = local[i];
            const nixlMetaDesc &r = remote[i];
            auto lmd = static_cast<const LocalMD *>(l.metadataP);
            auto rmd = static_cast<const RemoteMD *>(r.metadataP);
            if (lmd == nullptr || rmd == nullptr || l.len != r.len || l.addr < lmd->base || r.addr < rmd->base) {
                NIXL_ERROR << "FABRIC: prepXfer: descriptor " << i << " does not match its registered memory";
                delete req;
                return NIXL_ERR_INVALID_PARAM;
            }
            req->entries.push_back(fabric_batch_entry{lmd->region, static_cast<uint64_t>(l.addr - lmd->base),
                                                      rmd->remote, static_cast<uint64_t>(r.addr - rmd->base),
                                                      static_cast<uint64_t>(l.len)});
        }
        req->local = agent == localAgent;
        if (!req->local && !peer_of(agent, req->peer)) {
            NIXL_ERROR << "FABRIC: prepXfer: no connection info of agent " << agent;
            delete req;
            return NIXL_ERR_NOT_FOUND;
        }
        handle = req;
        return NIXL_SUCCESS;
    }

    nixl_status_t postXfer(const nixl_xfer_op_t &, const nixl_meta_dlist_t &, const nixl_meta_dlist_t &,
                           const std::string &agent, nixlBackendReqH *&handle,
                           const nixl_opt_b_args_t *opt) const override {
        auto req = static_cast<Request *>(handle);
        if (req->data != nullptr && fabric_op_test(req->data) == FABRIC_STATUS_IN_PROGRESS) {
            return NIXL_ERR_REPOST_ACTIVE;
        }
        fabric_op_free(req->data);
        fabric_op_free(req->notif);
        req->data = nullptr;
        req->notif = nullptr;
        req->failed = FABRIC_STATUS_OK;
        req->has_notif = opt != nullptr && opt->hasNotif;
        if (req->has_notif) {
            /* To ourselves: straight into the list getNotifs hands out. */
            const bool local = agent == localAgent;
            req->message = local ? std::string() : notification(opt->notifMsg);
            req->local_notif = local ? opt->notifMsg : std::string();
        }
        fabric_status s = fabric_batch(engine_, req->op, req->entries.data(), req->entries.size(), &req->data);
        if (s != FABRIC_STATUS_OK) return fail("FABRIC: postXfer", s);
        return checkXfer(req);
    }

    nixl_status_t checkXfer(nixlBackendReqH *handle) const override {
        auto req = static_cast<Request *>(handle);
        if (req->data == nullptr) return NIXL_ERR_NOT_POSTED;
        fabric_status s = fabric_op_test(req->data);
        if (s == FABRIC_STATUS_IN_PROGRESS) return NIXL_IN_PROG;
        if (s != FABRIC_STATUS_OK) return failed(req, s);
        if (!req->has_notif) return NIXL_SUCCESS;
        if (req->local) {
            /* A local transfer's notification. */
            std::lock_guard<std::mutex> g(lock_);
            local_notifs_.emplace_back(localAgent, req->local_notif);
            req->has_notif = false;
            return NIXL_SUCCESS;
        }
        if (req->notif == nullptr) {
            s = fabric_send(engine_, req->peer, reinterpret_cast<const uint8_t *>(req->message.data()),
                            req->message.size(), &req->notif);
            if (s != FABRIC_STATUS_OK) return fail("FABRIC: notification", s);
        }
        s = fabric_op_test(req->notif);
        if (s == FABRIC_STATUS_IN_PROGRESS) return NIXL_IN_PROG;
        return s == FABRIC_STATUS_OK ? NIXL_SUCCESS : fail("FABRIC: notification", s);
    }

    /* A failed transfer. A write into a process that just died can fail as a refused
     * access (shm) or a lost connection before the engine has seen the process gone (its
     * pidfd, its liveness connection: within about 20 ms): such a failure is held back,
     * the request staying in progress, for up to 100 ms or until the peer is known down,
     * so that NIXL hears NIXL_ERR_REMOTE_DISCONNECT for a dead peer and drops it. */
    nixl_status_t failed(Request *req, fabric_status s) const {
        const bool maybe_dead = s == FABRIC_STATUS_ERR_REMOTE_ACCESS || s == FABRIC_STATUS_ERR_CONNECTION_LOST;
        if (!maybe_dead || req->local) return fail("FABRIC: transfer", s);
        const auto now = std::chrono::steady_clock::now();
        if (req->failed == FABRIC_STATUS_OK) {
            req->failed = s;
            req->failed_at = now;
        }
        if (fabric_peer_status(engine_, req->peer) == FABRIC_STATUS_ERR_PEER_UNREACHABLE) {
            return fail("FABRIC: transfer (the peer is gone)", FABRIC_STATUS_ERR_PEER_UNREACHABLE);
        }
        if (now - req->failed_at < std::chrono::milliseconds(100)) return NIXL_IN_PROG;
        return fail("FABRIC: transfer", req->failed);
    }

    nixl_status_t releaseReqH(nixlBackendReqH *handle) const override {
        /* fabric cannot recall an operation the NIC has: a request in flight is given up to
         * 100 ms to finish; if it is still running, the release fails (NIXL's documented
         * answer for a transfer that cannot be aborted) and may be retried. */
        auto req = static_cast<Request *>(handle);
        for (fabric_op *op : {req->data, req->notif}) {
            if (op != nullptr && fabric_op_wait(op, 100) == FABRIC_STATUS_ERR_TIMEOUT) {
                NIXL_WARN << "FABRIC: releaseReqH: the request is still in flight and cannot be aborted";
                return NIXL_ERR_REPOST_ACTIVE;
            }
        }
        delete req;
        return NIXL_SUCCESS;
    }

    nixl_status_t getNotifs(notif_list_t &list) override {
        {
            std::lock_guard<std::mutex> g(lock_);
            for (auto &n : local_notifs_) list.push_back(std::move(n));
            local_notifs_.clear();
        }
        std::lock_guard<std::mutex> g(recv_lock_);
        for (;;) {
            uint32_t peer = 0;
            size_t len = 0;
            fabric_status s = fabric_try_recv(engine_, &peer, recv_buf_.data(), recv_buf_.size(), &len);
            if (s == FABRIC_STATUS_ERR_AGAIN) return NIXL_SUCCESS;
            if (s != FABRIC_STATUS_OK) return fail("FABRIC: getNotifs", s);
            uint32_t name_len = 0;
            if (len < 4) continue;
            std::memcpy(&name_len, recv_buf_.data(), 4);
            if (static_cast<size_t>(name_len) > len - 4) {
                NIXL_WARN << "FABRIC: a malformed notification of " << len << " bytes was dropped";
                continue;
            }
            const char *p = reinterpret_cast<const char *>(recv_buf_.data());
            list.emplace_back(std::string(p + 4, name_len), std::string(p + 4 + name_len, len - 4 - name_len));
        }
    }

    nixl_status_t genNotif(const std::string &agent, const std::string &msg) const override {
        if (agent == localAgent) {
            std::lock_guard<std::mutex> g(lock_);
            local_notifs_.emplace_back(localAgent, msg);
            return NIXL_SUCCESS;
        }
        uint32_t peer = 0;
        if (!peer_of(agent, peer)) return NIXL_ERR_NOT_FOUND;
        const std::string m = notification(msg);
        fabric_op *op = nullptr;
        fabric_status s = fabric_send(engine_, peer, reinterpret_cast<const uint8_t *>(m.data()), m.size(), &op);
        if (s != FABRIC_STATUS_OK) return fail("FABRIC: genNotif", s);
        /* Posted; freeing the handle does not recall the send. A failure seen already is
         * reported. */
        s = fabric_op_test(op);
        fabric_op_free(op);
        return s == FABRIC_STATUS_OK || s == FABRIC_STATUS_IN_PROGRESS ? NIXL_SUCCESS : fail("FABRIC: genNotif", s);
    }

private:
    std::string param(const std::string &key, const std::string &def) const {
        std::string v;
        return getInitParam(key, v) == NIXL_SUCCESS && !v.empty() ? v : def;
    }

    bool peer_of(const std::string &agent, uint32_t &peer) const {
        std::lock_guard<std::mutex> g(lock_);
        auto it = peers_.find(agent);
        if (it == peers_.end()) return false;
        peer = it->second;
        return true;
    }

    std::string notification(const std::string &payload) const {
        std::string m;
        const uint32_t n = static_cast<uint32_t>(localAgent.size());
        m.resize(4);
        std::memcpy(m.data(), &n, 4);
        m += localAgent;
        m += payload;
        return m;
    }

    fabric_engine *engine_ = nullptr;
    std::string provider_;
    std::string nics_;
    mutable std::mutex lock_;
    std::unordered_map<std::string, uint32_t> peers_;
    mutable notif_list_t local_notifs_;
    std::mutex recv_lock_;
    std::vector<uint8_t> recv_buf_;
};

nixl_b_params_t options() {
    return {{"provider", "tcp"},        {"nics", ""},         {"domains", "0"}, {"mode", "inline"},
            {"op_timeout_ms", "30000"}, {"max_msg_size", "131072"}, {"cuda_ipc", "-1"}, {"chunk", "0"}};
}

} // namespace

extern "C" NIXL_PLUGIN_EXPORT nixlBackendPlugin *nixl_plugin_init() {
    return nixlBackendPluginCreator<FabricEngine>::create(NIXL_PLUGIN_API_VERSION, kName, kVersion, options(),
                                                          {DRAM_SEG, VRAM_SEG});
}

extern "C" NIXL_PLUGIN_EXPORT void nixl_plugin_fini() {}
