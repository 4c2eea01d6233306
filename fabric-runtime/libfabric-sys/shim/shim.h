/*
 * Non-inline wrappers for the libfabric `static inline` calls fabric uses.
 *
 * libfabric implements most of its API as `static inline` functions that jump through
 * provider ops tables; those have no symbol in libfabric.so, so Rust cannot call them
 * directly. Each `fabric_shim_<name>` below forwards to `<name>` unchanged.
 */
#ifndef FABRIC_SHIM_H
#define FABRIC_SHIM_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>

/* FI_VERSION(1, 17): the API version fabric asks fi_getinfo for. */
uint32_t fabric_shim_version(void);

struct fi_info *fabric_shim_fi_allocinfo(void);
int fabric_shim_fi_domain(struct fid_fabric *fabric, struct fi_info *info,
			  struct fid_domain **domain, void *context);
int fabric_shim_fi_endpoint(struct fid_domain *domain, struct fi_info *info,
			    struct fid_ep **ep, void *context);
int fabric_shim_fi_cq_open(struct fid_domain *domain, struct fi_cq_attr *attr,
			   struct fid_cq **cq, void *context);
int fabric_shim_fi_av_open(struct fid_domain *domain, struct fi_av_attr *attr,
			   struct fid_av **av, void *context);
int fabric_shim_fi_ep_bind(struct fid_ep *ep, struct fid *bfid, uint64_t flags);
int fabric_shim_fi_enable(struct fid_ep *ep);
int fabric_shim_fi_getname(fid_t fid, void *addr, size_t *addrlen);
int fabric_shim_fi_av_insert(struct fid_av *av, const void *addr, size_t count,
			     fi_addr_t *fi_addr, uint64_t flags, void *context);
int fabric_shim_fi_av_remove(struct fid_av *av, fi_addr_t *fi_addr, size_t count,
			     uint64_t flags);
int fabric_shim_fi_mr_reg(struct fid_domain *domain, const void *buf, size_t len,
			  uint64_t acs, uint64_t offset, uint64_t requested_key,
			  uint64_t flags, struct fid_mr **mr, void *context);
int fabric_shim_fi_mr_reg_cuda(struct fid_domain *domain, const void *buf, size_t len,
			       uint64_t acs, uint64_t requested_key, int device,
			       struct fid_mr **mr);
void *fabric_shim_fi_mr_desc(struct fid_mr *mr);
uint64_t fabric_shim_fi_mr_key(struct fid_mr *mr);
int fabric_shim_fi_mr_bind(struct fid_mr *mr, struct fid *bfid, uint64_t flags);
int fabric_shim_fi_mr_enable(struct fid_mr *mr);
int fabric_shim_fi_close(struct fid *fid);
ssize_t fabric_shim_fi_writedata(struct fid_ep *ep, const void *buf, size_t len,
				 void *desc, uint64_t data, fi_addr_t dest_addr,
				 uint64_t addr, uint64_t key, void *context);
ssize_t fabric_shim_fi_writemsg(struct fid_ep *ep, const struct fi_msg_rma *msg,
				uint64_t flags);
ssize_t fabric_shim_fi_write(struct fid_ep *ep, const void *buf, size_t len,
			     void *desc, fi_addr_t dest_addr, uint64_t addr,
			     uint64_t key, void *context);
ssize_t fabric_shim_fi_read(struct fid_ep *ep, void *buf, size_t len, void *desc,
			    fi_addr_t src_addr, uint64_t addr, uint64_t key,
			    void *context);
ssize_t fabric_shim_fi_send(struct fid_ep *ep, const void *buf, size_t len,
			    void *desc, fi_addr_t dest_addr, void *context);
ssize_t fabric_shim_fi_recv(struct fid_ep *ep, void *buf, size_t len, void *desc,
			    fi_addr_t src_addr, void *context);
ssize_t fabric_shim_fi_cq_read(struct fid_cq *cq, void *buf, size_t count);
ssize_t fabric_shim_fi_cq_readfrom(struct fid_cq *cq, void *buf, size_t count,
				   fi_addr_t *src_addr);
ssize_t fabric_shim_fi_cq_readerr(struct fid_cq *cq, struct fi_cq_err_entry *buf,
				  uint64_t flags);
const char *fabric_shim_fi_cq_strerror(struct fid_cq *cq, int prov_errno,
				       const void *err_data, char *buf, size_t len);
int fabric_shim_fi_control(struct fid *fid, int command, void *arg);
int fabric_shim_fi_trywait(struct fid_fabric *fabric, struct fid **fids, int count);

#endif /* FABRIC_SHIM_H */
